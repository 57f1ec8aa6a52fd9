"""Streaming through a registry: seq, replay with after=, lag, teardown, and ref.stream()."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from memory import grow_trio_task_table, traced_memory
from sessionactors.stores import JournalEntry, load_events
from sessionactors.testing import EchoModel, FaultyStore, Gate, Scripted, ScriptedModel
from stream_checks import numbered_on

OUTCOMES = (sa.TurnFinished, sa.TurnFailed, sa.TurnCancelled)
JOURNALED = (sa.TurnStarted, sa.MessageAdded, *OUTCOMES)


def journal_seqs(entries: list[JournalEntry], after: int = 0) -> list[int]:
    """The seqs of the events in journal entries (an entry holds one commit's events)."""
    return [e.seq for entry in entries for e in load_events(entry.data) if e.seq > after]


def is_outcome(event: sa.Event) -> bool:
    return isinstance(event, OUTCOMES)


def scripted(*steps: object) -> dict[str, sa.Agent]:
    return {"scripted": sa.Agent(model=ScriptedModel(list(steps)))}  # type: ignore[arg-type]


async def read(events: AsyncIterator[sa.Event], count: int) -> list[sa.Event]:
    """The next ``count`` events."""
    with trio.fail_after(60):
        return [await anext(events) for _ in range(count)]


async def read_until(
    events: AsyncIterator[sa.Event], stop: Callable[[sa.Event], bool]
) -> list[sa.Event]:
    """Events up to and including the first for which ``stop`` holds."""
    got: list[sa.Event] = []
    with trio.fail_after(60):
        async for event in events:
            got.append(event)
            if stop(event):
                return got
    raise AssertionError(f"the events ended before the expected one; got {got!r}")


async def read_to_end(events: AsyncIterator[sa.Event]) -> list[sa.Event]:
    with trio.fail_after(60):
        return [event async for event in events]


async def assert_quiet(events: AsyncIterator[sa.Event]) -> None:
    """The subscription stays open and delivers nothing for a while."""
    with trio.move_on_after(60):
        event = await anext(events)
        pytest.fail(f"expected no event, got {event!r}")


async def latest_seq(ref: sa.SessionRef) -> int:
    with trio.fail_after(10):
        return (await ref.state()).event_seq


def seqs(events: list[sa.Event]) -> list[int]:
    return [e.seq for e in events]


def is_hibernated(event: sa.Event) -> bool:
    return isinstance(event, sa.StatusChanged) and event.status is sa.Status.HIBERNATED


def consecutive(values: list[int]) -> bool:
    return values == list(range(values[0], values[0] + len(values)))


# ---- seq ------------------------------------------------------------------------


async def test_every_event_kind_gets_the_next_seq(autojump_clock: trio.testing.MockClock) -> None:
    """Events of every kind are numbered with strictly increasing, gap-free seqs while live."""
    gate = trio.Event()
    agents = scripted(
        "hello there", ValueError("boom"), Scripted(chunks=["a ", "b"], wait=gate, wait_after=1)
    )
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("kinds")
        async with ref.subscribe() as events:
            start = await latest_seq(ref)
            with trio.fail_after(10):
                await ref.send("hi")
                with pytest.raises(sa.TurnFailedError):
                    await ref.send("fail")
                turn = await ref.submit("cancel me")
                got = await read_until(
                    events, lambda e: isinstance(e, sa.Delta) and e.turn_id == turn.id
                )
                await ref.cancel()
                with pytest.raises(sa.TurnCancelledError):
                    await turn.reply()
            final = await latest_seq(ref)
            got += await read_until(events, lambda e: e.seq == final)
    # the first write after the wake jumped (its status says from where); on by one after
    assert numbered_on(got, start)
    assert got[0].skipped_from == start + 1  # type: ignore[attr-defined]
    assert got[-1].seq == final
    kinds = {type(e) for e in got}
    assert kinds >= {
        sa.TurnStarted,
        sa.Delta,
        sa.MessageAdded,
        sa.TurnFinished,
        sa.TurnFailed,
        sa.TurnCancelled,
        sa.StatusChanged,
    }


async def test_seqs_are_counted_per_session(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """Two sessions number their events independently, each on by one from its wake's
    jump, even when interleaved."""
    async with sa.open_registry(agents=echo_agents) as registry:
        a = await registry.spawn("a")
        b = await registry.spawn("b")
        async with a.subscribe() as events_a, b.subscribe() as events_b:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    for ref, text in ((a, "one two three"), (b, "four"), (a, "five six")):
                        nursery.start_soon(ref.send, text)
            final_a, final_b = await latest_seq(a), await latest_seq(b)
            got_a = await read_until(events_a, lambda e: e.seq == final_a)
            got_b = await read_until(events_b, lambda e: e.seq == final_b)
    assert numbered_on(got_a, 0)
    assert numbered_on(got_b, 0)
    assert (got_a[-1].seq, got_b[-1].seq) == (final_a, final_b)
    assert {e.session_id for e in got_a} == {"a"}
    assert {e.session_id for e in got_b} == {"b"}
    assert final_a - got_a[0].seq > final_b - got_b[0].seq


async def test_seq_keeps_rising_across_hibernation(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """After hibernate and wake, a session's new events have seqs above all its old ones."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("sleepy")
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("one two")
            old = await read_until(events, is_outcome)
        with trio.fail_after(10):
            await ref.hibernate()
        assert registry.live() == []
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("three")
            new = await read_until(events, is_outcome)
    assert min(seqs(new)) > max(seqs(old))
    assert consecutive(seqs(new))


async def test_seq_is_gap_free_across_hibernation_for_an_open_subscriber(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """A subscriber open across a clean hibernate and wake sees seqs without a gap, but
    the wake's jump, which its status records."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("sleepy")
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("one two")
                await ref.hibernate()
                assert registry.live() == []
                await ref.send("three")
            final = await latest_seq(ref)
            got = await read_until(events, lambda e: e.seq == final)
    assert numbered_on(got, 0)
    assert got[-1].seq == final
    jumps = [e for e in got if isinstance(e, sa.StatusChanged) and e.skipped_from]
    assert len(jumps) == 2  # the spawn's first wake, and the wake after the hibernation
    # the wake journals (and publishes) its idle status before the turn after it
    assert any(isinstance(e, sa.StatusChanged) and e.status is sa.Status.IDLE for e in got)
    assert any(isinstance(e, sa.StatusChanged) and e.status is sa.Status.HIBERNATED for e in got)


async def test_seq_keeps_rising_across_a_registry_restart(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """A session woken by a new registry over the same store continues above its old seqs."""
    store = sa.MemoryStore()
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        ref = await registry.spawn("durable")
        with trio.fail_after(10):
            await ref.send("one two")
        old_final = await latest_seq(ref)
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        ref = registry.ref("durable")
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("three")
            new = await read_until(events, is_outcome)
    assert min(seqs(new)) > old_final


# ---- after= ---------------------------------------------------------------------


async def test_subscribe_without_after_starts_at_the_next_event(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """subscribe() replays nothing and delivers from the next event on."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("now")
        with trio.fail_after(10):
            await ref.send("earlier words")
        latest = await latest_seq(ref)
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("later")
            got = await read_until(events, is_outcome)
    assert got[0].seq == latest + 1
    assert consecutive(seqs(got))
    assert not any(isinstance(e, sa.TurnStarted) and e.text == "earlier words" for e in got)


async def test_after_replays_then_continues_live_with_no_gap_or_duplicate(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """subscribe(after=seq) replays the later events, then goes live seamlessly while publishing."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("replay")
        async with ref.subscribe() as reference:
            with trio.fail_after(10):
                await ref.send("one two three four")
            first_turn = await read_until(reference, is_outcome)
            after = first_turn[3].seq
            async with ref.subscribe(after=after) as events:
                got = await read(events, 1)
                turn = await ref.submit("five six seven")  # published into the open subscription
                await trio.testing.wait_all_tasks_blocked()
                with trio.fail_after(10):
                    await turn.reply()
                final = await latest_seq(ref)
                got += await read_until(events, lambda e: e.seq == final)
            expected = first_turn + await read_until(reference, lambda e: e.seq == final)
    assert seqs(got) == list(range(after + 1, final + 1))
    assert got == [e for e in expected if e.seq > after]


@pytest.mark.parametrize("durability", ["turn", "hibernate"])
async def test_a_state_read_mid_turn_and_a_subscription_after_its_seq_draw_the_whole_reply(
    autojump_clock: trio.testing.MockClock, durability: str
) -> None:
    """A page that loads while a reply streams draws ``ref.state()``'s messages, then
    follows with ``after=state.event_seq`` (the how-tos' and the chat page's steps): the
    state holds no draft of the reply, so the subscription replays every delta streamed
    so far, and the deltas it draws make the whole reply."""
    gate = Gate()
    answer = Scripted(chunks=[f"w{i} " for i in range(8)], wait=gate, wait_after=5)
    agents = {"scripted": sa.Agent(model=ScriptedModel([answer]))}
    async with sa.open_registry(agents=agents, durability=durability) as registry:
        ref = await registry.spawn("s")
        turn = await ref.submit("hi")
        await trio.testing.wait_all_tasks_blocked()
        state = await ref.state()  # five deltas streamed, the turn held open
        assert [m.content for m in state.messages] == ["hi"]
        drawn = ""
        async with ref.subscribe(after=state.event_seq) as events:
            gate.open()
            with trio.fail_after(10):
                async for event in events:
                    if isinstance(event, sa.Delta):
                        drawn += event.text
                    if isinstance(event, sa.TurnFinished):
                        break
        assert drawn == event.message.content == (await turn.reply()).text


async def test_after_the_latest_seq_replays_nothing(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """subscribe(after=latest) replays nothing and then delivers the next event."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("latest")
        with trio.fail_after(10):
            await ref.send("one two")
        latest = await latest_seq(ref)
        async with ref.subscribe(after=latest) as events:
            await assert_quiet(events)
            with trio.fail_after(10):
                await ref.send("three")
            got = await read_until(events, is_outcome)
    assert got[0].seq == latest + 1
    assert consecutive(seqs(got))


async def test_negative_after_is_rejected(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """subscribe(after=-1) raises ValueError and leaves no subscriber behind."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("negative")
        with pytest.raises(ValueError, match="after"):
            async with ref.subscribe(after=-1):
                pass  # pragma: no cover
        assert registry.statistics().subscribers == 0


async def test_store_replay_seam_has_no_gap_or_duplicate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Replay from beyond the ring joins the live events with no duplicate and no missing
    durable or newly published event, even when the turn runs on during the journal read."""
    gate = trio.Event()
    agents = scripted(
        "w0 w1 w2 w3 w4 w5 w6 w7",
        Scripted(chunks=[f"c{i} " for i in range(8)], wait=gate, wait_after=5),
    )
    store = FaultyStore()
    async with sa.open_registry(agents=agents, store=store, replay_events=4) as registry:
        ref = await registry.spawn("seam")
        async with ref.subscribe() as reference:
            with trio.fail_after(10):
                await ref.send("first")
                second = await ref.submit("second")
                await trio.testing.wait_all_tasks_blocked()  # five chunks streamed, then held
                head = await read_until(reference, lambda e: isinstance(e, sa.TurnStarted))
            after = head[-1].seq  # the first turn's start
            head += await read_until(
                reference, lambda e: isinstance(e, sa.Delta) and e.text == "c4 "
            )
            published_before = head[-1].seq  # the last event published so far
            assert published_before - after > 4  # more than the ring keeps: the journal is read
            got: list[sa.Event] = []

            async def replayer() -> None:
                async with ref.subscribe(after=after) as events:
                    got.extend(await read_until(events, lambda e: e.seq == final))

            read = store.hold("read_journal", after=True)
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(replayer)
                    await trio.testing.wait_all_tasks_blocked()
                    assert read.waiting == 1  # the journal is read; its answer is held
                    gate.set()  # the turn finishes and commits while the read is held
                    await second.reply()
                    final = await latest_seq(ref)
                    read.open()
            everything = head + await read_until(reference, lambda e: e.seq == final)
    got_seqs = seqs(got)
    assert got_seqs == sorted(set(got_seqs))
    assert all(e in everything for e in got)
    required = [
        e
        for e in everything
        if e.seq > published_before or (e.seq > after and isinstance(e, JOURNALED))
    ]
    assert [e for e in got if e in required] == required


async def crash_on_the_outcome(*, kept: bool) -> tuple[list[sa.Event], list[sa.Event]]:
    """A turn whose outcome commit raises (with ``kept``, after the store kept it): the
    events a subscriber saw live, and those replayed from the ring after the turn."""
    store = FaultyStore()
    live: list[sa.Event] = []
    async with sa.open_registry(store=store, agents=scripted("first", "second")) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            await ref.send("one")
            before = (await ref.state()).event_seq
            async with ref.subscribe() as events:
                store.fail("append", session_id="s", after=kept)
                turn = await ref.submit("two")
                with pytest.raises(sa.SessionCrashedError) as crashed:
                    await turn.reply()
                live = await read_until(events, lambda e: is_outcome(e) and e.turn_id == turn.id)
                outcome = await ref.turn_outcome(turn.id)
            async with ref.subscribe(after=before) as events:
                ring = await read_until(events, lambda e: is_outcome(e) and e.turn_id == turn.id)
            history = [m.content for m in await ref.history()]
    assert store.injected == 1  # the fault fired, once
    # its caller cannot know either: it is told how to find out before sending it again
    assert f"ref.turn_outcome({turn.id!r})" in str(crashed.value)
    finished = outcome.status is sa.TurnStatus.FINISHED
    assert finished is kept
    assert history == ["one", "first", "two", "second"] if kept else ["one", "first"]
    return live, ring


async def test_an_outcome_the_store_kept_though_its_write_raised_is_published() -> None:
    """A turn whose outcome write raised but was kept by the store is published as it ended
    (TurnFinished, not as lost), live and to a subscriber resuming from the ring, with
    rising seqs; its caller is told to ask turn_outcome before sending it again."""
    live, ring = await crash_on_the_outcome(kept=True)
    assert live[-1] == ring[-1]
    assert isinstance(live[-1], sa.TurnFinished)
    assert live[-1].message.content == "second"
    assert [e for e in live if isinstance(e, sa.TurnFailed)] == []
    assert seqs(live) == sorted(set(seqs(live)))
    assert seqs(ring) == sorted(set(seqs(ring)))


async def test_an_outcome_the_store_did_not_keep_is_published_as_lost() -> None:
    """A turn whose outcome write failed (negative control) is published as lost, live and
    from the ring, and never as finished."""
    live, ring = await crash_on_the_outcome(kept=False)
    assert live[-1] == ring[-1]
    assert isinstance(live[-1], sa.TurnFailed)
    assert live[-1].lost
    assert [e for e in live if isinstance(e, sa.TurnFinished)] == []


async def test_expired_events_raise_with_the_oldest_available_seq(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """Once the journal is trimmed, after=1 raises EventsExpiredError; after=oldest_seq-1 works."""
    async with sa.open_registry(
        agents=echo_agents, replay_events=3, journal_keep_events=4, snapshot_every=1
    ) as registry:
        ref = await registry.spawn("trimmed")
        with trio.fail_after(10):
            for i in range(8):  # long turns: their entries outweigh the snapshots
                await ref.send(f"turn {i} " + "x" * 2000)
            await ref.hibernate()  # the snapshot trims the journal
        trimmed, entries = await registry.store.read_journal("trimmed", 0)
        assert trimmed > 1
        assert registry.live() == []
        for _ in range(2):  # hibernated, then live again
            with pytest.raises(sa.EventsExpiredError) as info:
                async with ref.subscribe(after=1):
                    pass  # pragma: no cover
            assert info.value.oldest_seq == trimmed + 1
            assert info.value.session_id == "trimmed"
            assert registry.statistics().subscribers == 0
            expected = journal_seqs(entries, after=info.value.oldest_seq - 1)
            async with ref.subscribe(after=info.value.oldest_seq - 1) as events:
                got = await read_until(events, lambda e, last=expected[-1]: e.seq == last)
            # every journaled event, and the live ring's deltas of the newest turn
            assert [e.seq for e in got if not isinstance(e, sa.Delta)] == expected
            with trio.fail_after(10):
                await ref.send("wake up")
            trimmed, entries = await registry.store.read_journal("trimmed", 0)


async def test_replay_across_hibernation_comes_from_the_journal(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """After hibernation, after=seq replays the journaled events (every MessageAdded and
    TurnFinished among them) with their original seqs, then continues live."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("journal")
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("one two")
                await ref.send("three four five")
                await ref.hibernate()
            live = await read_until(events, is_hibernated)
        after = live[1].seq
        _, entries = await registry.store.read_journal("journal", after)
        journaled = set(journal_seqs(entries, after=after))
        expected = [e for e in live if e.seq in journaled]
        assert len(expected) == len(journaled)
        async with ref.subscribe(after=after) as events:
            got = await read(events, len(expected))
            await assert_quiet(events)
            assert registry.live() == []
            with trio.fail_after(10):
                await ref.send("six")
            more = await read_until(events, is_outcome)
    assert got == expected
    message_level = [e for e in live if e.seq > after and isinstance(e, JOURNALED)]
    assert [e for e in got if isinstance(e, JOURNALED)] == message_level
    assert {sa.TurnStarted, sa.TurnFinished} <= {type(e) for e in got}
    assert not consecutive(seqs(got))  # gaps where the deltas were
    assert min(seqs(more)) > max(seqs(live))


# ---- reconnecting (property) ---------------------------------------------------------


async def reconnect_scenario(
    words_per_turn: list[int], plan: list[tuple[int, int]]
) -> tuple[list[sa.Event], list[sa.Event]]:
    """Stream the turns to a steady subscriber and to one reconnecting by ``plan``:
    (events to read before leaving, milliseconds away)."""
    agents = {"echo": sa.Agent(model=EchoModel(delay=0.003))}
    steady: list[sa.Event] = []
    flaky: list[sa.Event] = []
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("flaky")

        async def reconnecting(start: int) -> None:
            last = start
            steps = list(plan)
            while True:
                budget, away = steps.pop(0) if steps else (None, 0)
                async with ref.subscribe(after=last) as events:
                    read_now = 0
                    while budget is None or read_now < budget:
                        event = await anext(events)
                        flaky.append(event)
                        last = event.seq
                        read_now += 1
                        if is_hibernated(event):
                            return
                await trio.sleep(away / 1000)

        async def drive() -> None:
            for count in words_per_turn:
                await ref.send(" ".join(f"w{i}" for i in range(count)))
            await ref.hibernate()

        async with ref.subscribe() as events:
            with trio.fail_after(600):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reconnecting, await latest_seq(ref))
                    nursery.start_soon(drive)
                    steady.extend(await read_until(events, is_hibernated))
    return steady, flaky


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words_per_turn=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    plan=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 20)), max_size=8),
)
def test_reconnecting_subscriber_sees_every_event_once_in_order(
    words_per_turn: list[int], plan: list[tuple[int, int]]
) -> None:
    """A subscriber that leaves and resubscribes with after=last seen seq sees the same events,
    once each and in seq order, as one that never left."""
    steady, flaky = trio.run(
        reconnect_scenario,
        words_per_turn,
        plan,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert seqs(flaky) == seqs(steady)
    assert flaky == steady
    assert consecutive(seqs(steady))


# ---- slow and stuck readers -------------------------------------------------------------


async def test_fast_slow_and_stuck_subscribers_of_ten_thousand_deltas(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Over 10,000 deltas the fast reader gets all, the stuck one lags at the bound, the slow one
    gets an unbroken prefix, the turn completes, and the lagged one resumes from the ring."""
    count, bound = 10_000, 100
    chunks = [f"{i} " for i in range(count)]
    agents = scripted(Scripted(chunks=chunks, delay=0.001))
    async with sa.open_registry(agents=agents, subscriber_buffer=bound) as registry:
        ref = await registry.spawn("firehose")
        fast: list[sa.Event] = []
        slow: list[sa.Event] = []
        stuck: list[sa.Event] = []
        errors: dict[str, sa.SubscriberLaggedError] = {}
        turn_done = trio.Event()

        async def fast_reader(*, task_status: trio.TaskStatus[None]) -> None:
            async with ref.subscribe() as events:
                task_status.started()
                fast.extend(await read_until(events, is_outcome))

        async def slow_reader(*, task_status: trio.TaskStatus[None]) -> None:
            async with ref.subscribe() as events:
                task_status.started()
                try:
                    async for event in events:
                        slow.append(event)
                        if is_outcome(event):
                            return
                        await trio.sleep(0.003)
                except sa.SubscriberLaggedError as exc:
                    errors["slow"] = exc

        async def stuck_reader(*, task_status: trio.TaskStatus[None]) -> None:
            async with ref.subscribe() as events:
                task_status.started()
                await turn_done.wait()
                try:
                    async for event in events:
                        stuck.append(event)
                except sa.SubscriberLaggedError as exc:
                    errors["stuck"] = exc

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for reader in (fast_reader, slow_reader, stuck_reader):
                    await nursery.start(reader)
                assert registry.statistics().subscribers == 3
                reply = await ref.send("go")
                turn_done.set()
        final = await latest_seq(ref)

        assert reply.text == "".join(chunks)
        assert [e.text for e in fast if isinstance(e, sa.Delta)] == chunks
        assert consecutive(seqs(fast))
        assert isinstance(fast[-1], sa.TurnFinished)

        assert len(stuck) == bound
        assert consecutive(seqs(stuck))
        assert stuck[0].seq == fast[0].seq
        assert errors["stuck"].last_seq == stuck[-1].seq

        assert slow[0].seq == fast[0].seq
        assert consecutive(seqs(slow))
        if "slow" in errors:
            assert errors["slow"].last_seq == slow[-1].seq
        else:
            assert slow == fast

        assert registry.statistics().subscribers == 0
        async with ref.subscribe(after=errors["stuck"].last_seq) as events:
            resumed = await read_until(events, lambda e: e.seq == final)
    ring = [e for e in fast if e.seq > final - 1000]  # the newest 1000 (replay_events)
    assert resumed[: len(ring)] == ring  # what the fast reader saw, from the ring
    assert seqs(resumed) == list(range(final - 999, final + 1))  # the ring holds 1000 events
    resumed_deltas = [e.text for e in resumed if isinstance(e, sa.Delta)]
    assert resumed_deltas == chunks[-len(resumed_deltas) :]
    assert len(resumed_deltas) == len(resumed) - 1  # then the TurnFinished


# ---- teardown ----------------------------------------------------------------------


async def test_leaving_the_block_removes_the_subscription(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """Leaving the subscribe block brings the subscriber count back to zero, and a live
    session keeps its replay ring for the next subscriber."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("leave")
        async with ref.subscribe(), ref.subscribe(after=0):
            assert registry.statistics().subscribers == 2
            with trio.fail_after(10):
                await ref.send("hello there")
        assert registry.statistics().subscribers == 0
        async with ref.subscribe(after=0) as events:
            got = await read_until(events, is_outcome)
    assert [e.text for e in got if isinstance(e, sa.Delta)] == ["hello", " there"]


async def test_cancelled_subscriber_leaves_no_subscription(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """A subscriber task cancelled mid-iteration leaves no subscriber behind."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("cancelled")
        got: list[sa.Event] = []

        async def reader(*, task_status: trio.TaskStatus[None]) -> None:
            async with ref.subscribe() as events:
                task_status.started()
                async for event in events:
                    got.append(event)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader)
                await ref.send("one two three")
                await trio.testing.wait_all_tasks_blocked()
                assert registry.statistics().subscribers == 1
                nursery.cancel_scope.cancel()
        assert got
        assert registry.statistics().subscribers == 0


async def test_a_subscriber_to_a_session_that_is_not_live_leaves_cleanly(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """A subscription to a hibernated session ends cleanly when its block is left, when its
    task is cancelled, and when it was open while the session hibernated."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("dormant")
        with trio.fail_after(10):
            await ref.send("hello")
            await ref.hibernate()
        async with ref.subscribe():
            assert registry.statistics().subscribers == 1
        assert registry.statistics().subscribers == 0

        async def reader(*, task_status: trio.TaskStatus[None]) -> None:
            async with ref.subscribe() as events:
                task_status.started()
                async for _ in events:
                    pass  # pragma: no cover

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader)
                await trio.testing.wait_all_tasks_blocked()
                assert registry.statistics().subscribers == 1
                nursery.cancel_scope.cancel()
        assert registry.statistics().subscribers == 0

        kept = await registry.spawn("kept")
        async with kept.subscribe():
            with trio.fail_after(10):
                await kept.hibernate()
            assert registry.live() == []
        assert registry.statistics().subscribers == 0


SESSIONS = 512


async def test_subscriptions_to_sessions_that_are_not_live_leave_nothing_behind(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """Subscribing to many sessions that are not live (hibernated, stopped or unknown) and
    leaving again (by the block's end, a cancel, or after a hibernation seen while
    subscribed) leaves at most a few bytes per session in the registry."""
    store = sa.MemoryStore()

    async def reader(ref: sa.SessionRef, *, task_status: trio.TaskStatus[None]) -> None:
        async with ref.subscribe() as events:
            task_status.started()
            async for _ in events:
                pass

    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        with trio.fail_after(60):
            refs = [await registry.spawn(f"s{i}") for i in range(SESSIONS)]
            for ref in refs:
                await ref.send("hello")
            for i, ref in enumerate(refs):
                await (ref.stop() if i % 5 == 3 else ref.hibernate())
            await grow_trio_task_table(4 * SESSIONS)
        async with traced_memory(store) as held:
            with trio.fail_after(60):
                for i, ref in enumerate(refs):
                    if i % 5 == 0:  # left at the end of the block
                        async with ref.subscribe(after=0):
                            pass
                    elif i % 5 == 1:  # cancelled
                        async with trio.open_nursery() as nursery:
                            await nursery.start(reader, ref)
                            nursery.cancel_scope.cancel()
                    elif i % 5 == 2:  # woken and hibernated while subscribed
                        async with ref.subscribe():
                            await ref.history()
                            await ref.hibernate()
                    elif i % 5 == 3:  # stopped: the subscription ends at once
                        async with ref.subscribe() as events:
                            await read_to_end(events)
                    else:  # a name that is neither live nor stored
                        with pytest.raises(sa.SessionNotFoundError):
                            async with registry.ref(f"nobody{i}").subscribe():
                                pass  # pragma: no cover
        assert registry.statistics().subscribers == 0
        assert registry.live() == []
    # About 25 bytes a session are trio's (what a cancelled nursery leaves); a registry that
    # kept a replay hub for each session would hold about 110.
    assert held.bytes < 48 * SESSIONS, f"{held.bytes} bytes held after {SESSIONS} subscriptions"


# ---- sessions that are not live ---------------------------------------------------------


async def test_subscribing_to_a_hibernated_session_does_not_wake_it(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """A subscription to a hibernated session leaves it asleep, stays open, and receives its
    events when it next runs."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("asleep")
        with trio.fail_after(10):
            await ref.send("hello")
            await ref.hibernate()
        assert registry.live() == []
        async with ref.subscribe() as events:
            await assert_quiet(events)
            assert registry.live() == []
            with trio.fail_after(10):
                await registry.ref("asleep").send("again")
            got = await read_until(events, is_outcome)
    assert sa.TurnStarted in {type(e) for e in got}
    assert [e.text for e in got if isinstance(e, sa.TurnStarted)] == ["again"]
    assert consecutive(seqs(got))


async def test_subscribing_to_an_unknown_session_raises(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """Subscribing to a name that is neither live nor stored raises SessionNotFoundError."""
    async with sa.open_registry(agents=echo_agents) as registry:
        for after in (None, 0):
            with pytest.raises(sa.SessionNotFoundError):
                async with registry.ref("nobody").subscribe(after=after):
                    pass  # pragma: no cover
        assert registry.statistics().subscribers == 0


async def test_subscription_open_while_the_session_stops_ends_cleanly(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """A subscriber open while ref.stop() happens sees the stop and then its iteration ends."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("stopping")
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("bye")
                await ref.stop()
            got = await read_to_end(events)
        assert got[-1] == sa.StatusChanged(
            session_id="stopping", seq=got[-1].seq, status=sa.Status.STOPPED
        )
        assert registry.statistics().subscribers == 0


async def test_new_subscription_to_a_stopped_session_ends_cleanly(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """A new subscription to an already stopped session ends at once with no error."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("stopped")
        with trio.fail_after(10):
            await ref.send("bye")
            await ref.stop()
        for subscriber in (ref, registry.ref("stopped")):
            async with subscriber.subscribe() as events:
                assert await read_to_end(events) == []
        assert registry.statistics().subscribers == 0
        assert registry.live() == []


async def test_replay_from_a_stopped_session_ends_after_its_journal(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent]
) -> None:
    """subscribe(after=0) to a stopped session replays its journaled events, then ends."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("stopped")
        async with ref.subscribe() as events:
            with trio.fail_after(10):
                await ref.send("bye now")
                await ref.stop()
            live = await read_to_end(events)
        _, entries = await registry.store.read_journal("stopped", 0)
        async with ref.subscribe(after=0) as events:
            got = await read_to_end(events)
    assert seqs(got) == journal_seqs(entries)
    assert got == [e for e in live if e in got]
    assert [type(e) for e in got if isinstance(e, JOURNALED)] == [
        sa.TurnStarted,
        sa.TurnFinished,
    ]
    assert got[-1] == live[-1]  # StatusChanged(STOPPED) is journaled


# ---- ref.stream ----------------------------------------------------------------------


async def test_stream_yields_only_its_own_turn(autojump_clock: trio.testing.MockClock) -> None:
    """ref.stream(text) yields that turn's events only and ends after its TurnFinished."""
    gate = trio.Event()
    agents = scripted(
        Scripted(chunks=["one ", "two"], wait=gate, wait_after=1), "three four", "five"
    )
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("streamed")
        with trio.fail_after(10):
            first = await ref.submit("first")
            await trio.testing.wait_all_tasks_blocked()
            async with ref.stream("second") as events:
                third = await ref.submit("third")
                gate.set()
                got = await read_to_end(events)
            await first.reply()
            await third.reply()
    turn_ids = {getattr(e, "turn_id", None) for e in got}
    assert len(turn_ids) == 1
    assert turn_ids.isdisjoint({first.id, third.id, None})
    assert isinstance(got[0], sa.TurnStarted)
    assert (got[0].text, got[0].idempotency_key) == ("second", None)
    assert got[0].message is not None
    assert got[0].message.content == "second"
    assert [e.text for e in got if isinstance(e, sa.Delta)] == ["three", " four"]
    assert isinstance(got[-1], sa.TurnFinished)
    assert got[-1].message.content == "three four"
    assert [e for e in got if is_outcome(e)] == [got[-1]]


async def test_stream_ends_after_turn_failed(autojump_clock: trio.testing.MockClock) -> None:
    """ref.stream(text) ends after its TurnFailed when the model raises."""
    async with sa.open_registry(agents=scripted(ValueError("boom"))) as registry:
        ref = await registry.spawn("failing")
        async with ref.stream("hi") as events:
            got = await read_to_end(events)
    assert isinstance(got[-1], sa.TurnFailed)
    assert "boom" in got[-1].error
    assert [e for e in got if is_outcome(e)] == [got[-1]]


async def test_stream_ends_after_turn_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    """ref.stream(text) ends after its TurnCancelled when ref.cancel() stops the turn."""
    gate = trio.Event()
    agents = scripted(Scripted(chunks=["partial ", "never"], wait=gate, wait_after=1))
    async with sa.open_registry(agents=agents) as registry:
        ref = await registry.spawn("cancelling")
        async with ref.stream("hi") as events:
            got = await read_until(events, lambda e: isinstance(e, sa.Delta))
            with trio.fail_after(10):
                assert await ref.cancel()
            got += await read_to_end(events)
    assert isinstance(got[-1], sa.TurnCancelled)
    interrupted = [e.message for e in got if isinstance(e, sa.MessageAdded)][-1]
    assert interrupted.interrupted
    assert interrupted.content == "partial "


@pytest.mark.parametrize("turns", [1, 300], ids=["first page", "later page"])
async def test_a_replay_cut_by_a_delete_never_delivers_the_next_session_of_its_name(
    autojump_clock: trio.testing.MockClock, echo_agents: dict[str, sa.Agent], turns: int
) -> None:
    """A subscription replaying a session from the store (a page of its journal read
    slowly) while the session is deleted, and another is made under its name and runs a
    turn, ends with the deletion: it delivers no event of the other session (another
    conversation), whether the delete came during its first page or a later one."""
    store = FaultyStore()
    async with sa.open_registry(store=store, agents=echo_agents) as registry:
        old = await registry.spawn("s")
        with trio.fail_after(60):
            for i in range(turns):
                await old.send(f"old {i}")
            await old.hibernate()
        last = (await old.state()).event_seq
        got: list[sa.Event] = []
        ended: list[BaseException] = []

        async def replay(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                async with old.subscribe(after=0) as events:
                    task_status.started()
                    async for event in events:
                        got.append(event)
            except sa.SessionNotFoundError as exc:
                ended.append(exc)

        async with trio.open_nursery() as nursery:
            if turns == 1:
                gate = store.hold("read_journal")
                nursery.start_soon(replay)
            else:  # the first page read; the next one is held
                await nursery.start(replay)
                gate = store.hold("read_journal")
            await trio.testing.wait_all_tasks_blocked()
            assert gate.waiting == 1
            await registry.delete("s")
            new = await registry.spawn("s")
            with trio.fail_after(10):
                await new.send("another conversation")
            gate.open()
    assert [type(e) for e in ended] == [sa.SessionNotFoundError]
    assert "deleted" in str(ended[0])
    assert all(event.seq <= last for event in got), [e for e in got if e.seq > last]
    assert "another conversation" not in repr(got)
