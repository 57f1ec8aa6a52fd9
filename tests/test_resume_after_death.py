"""Resuming a stream after the process died mid-turn: a subscriber whose last seq lies
among the events the dead process published (never stored) hears that they are gone."""

from __future__ import annotations

import uuid

import pytest
import trio
import trio.testing

import sessionactors as sa
from durability_checks import Death, die_mid_turn
from sessionactors.stores import MemoryStore, RedisStore
from sessionactors.testing import EchoModel

ECHO = {"a": sa.Agent(model=EchoModel())}


def assert_gone(error: sa.EventsExpiredError, death: Death, state: sa.SessionState) -> None:
    assert error.session_id == "s"
    assert death.last < error.oldest_seq <= state.event_seq + 1
    assert "ref.state()" in str(error)
    assert "after=state.event_seq" in str(error)


async def test_a_resume_inside_a_lost_turn_after_the_wake_raises_expired() -> None:
    """A subscriber resuming inside a turn that died with its process, once the session
    woke again, gets EventsExpiredError; a resume after the reloaded state follows on."""
    store = MemoryStore()
    death = await die_mid_turn(store)
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("s")
        state = await ref.state()  # wakes it: its seq jumps past the dead process's
        with trio.fail_after(5), pytest.raises(sa.EventsExpiredError) as caught:
            async with ref.subscribe(after=death.last):
                pass
        assert_gone(caught.value, death, state)
        assert (await ref.turn_outcome(death.turn_id)).status is sa.TurnStatus.LOST
        async with ref.subscribe(after=state.event_seq) as events:
            turn = await ref.submit("three")
            with trio.fail_after(5):
                async for event in events:
                    assert event.seq > state.event_seq
                    if isinstance(event, sa.TurnFinished):
                        assert event.turn_id == turn.id
                        break


async def test_a_resume_inside_a_lost_turn_before_the_wake_raises_expired() -> None:
    """A subscriber that resumes inside a lost turn while the session is not live yet
    gets EventsExpiredError (the store's state was not stored cleanly: the next wake
    jumps past the seq), from the session woken to name the seq its events go on from
    (a wake later would jump further, as the clock does), and a later resume the same."""
    store = MemoryStore()
    death = await die_mid_turn(store)
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("s")
        with trio.fail_after(5), pytest.raises(sa.EventsExpiredError) as before:
            async with ref.subscribe(after=death.last):
                pass
        assert registry.live() == ["s"]
        state = await ref.state()
        assert_gone(before.value, death, state)
        with trio.fail_after(5), pytest.raises(sa.EventsExpiredError) as after:
            async with ref.subscribe(after=death.last):
                pass
        assert after.value.oldest_seq == before.value.oldest_seq


async def test_a_resume_inside_a_lost_turn_after_later_stops_raises_expired() -> None:
    """The store tells the lost turn's seqs too: once the woken session hibernated, and
    in a later process, before and after a wake, a resume inside the lost turn gets
    EventsExpiredError, and a resume at the last stored event before it does not."""
    store = MemoryStore()
    death = await die_mid_turn(store)

    async def check(ref: sa.SessionRef) -> None:
        with trio.fail_after(5), pytest.raises(sa.EventsExpiredError) as caught:
            async with ref.subscribe(after=death.last):
                pass
        assert_gone(caught.value, death, await ref.state())
        async with ref.subscribe(after=death.durable) as events:
            with trio.fail_after(5):
                async for event in events:
                    if isinstance(event, sa.TurnFinished):
                        assert event.message.content == "three"
                        break

    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("s")
        await ref.send("three")  # wakes it, past a seq jump
        await ref.hibernate()
        await check(ref)  # hibernated (then woken cleanly by check's ref.state())
        await check(ref)  # live
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("s")
        await check(ref)
        await check(ref)


@pytest.mark.parametrize("woken_first", [False, True], ids=["before-wake", "after-wake"])
async def test_a_resume_at_the_last_stored_event_replays_without_error(
    woken_first: bool,
) -> None:
    """After a death mid-turn, a subscriber resuming at or before the last stored event,
    or live, is not told of lost events: it gets the next turn."""
    store = MemoryStore()
    death = await die_mid_turn(store)
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("s")
        if woken_first:
            await ref.state()
        async with (
            ref.subscribe(after=death.durable) as at_durable,
            ref.subscribe(after=death.durable - 1) as before,
            ref.subscribe() as live,
        ):
            turn = await ref.submit("three")
            for events in (at_durable, before, live):
                with trio.fail_after(5):
                    async for event in events:
                        if isinstance(event, sa.TurnFinished) and event.turn_id == turn.id:
                            break


@pytest.mark.parametrize("how", ["hibernate", "close"])
async def test_a_resume_after_a_clean_stop_mid_stream_is_no_false_alarm(how: str) -> None:
    """A subscriber that last saw a Delta resumes after a clean hibernation or a clean
    close (no seq jump) with the rest of the session's events, and no error."""
    store = MemoryStore()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("s")
        async with ref.subscribe() as events:
            await ref.send("one two three")
            with trio.fail_after(5):
                async for event in events:
                    if isinstance(event, sa.Delta):
                        last = event.seq
                        break
        if how == "hibernate":
            await ref.hibernate()
            await ref.send("four")
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = registry.ref("s")
        for woken in (False, True):
            if woken:
                await ref.state()
            async with ref.subscribe(after=last) as events:
                turn = await ref.submit("five")
                with trio.fail_after(5):
                    async for event in events:
                        if isinstance(event, sa.TurnFinished) and event.turn_id == turn.id:
                            break


@pytest.mark.redis
async def test_a_resume_inside_a_lost_turn_on_another_worker_raises_expired(
    redis_url: str,
) -> None:
    """On a worker that does not run the session, a subscriber resuming inside a turn
    that died with its worker gets EventsExpiredError too (from the session's owner)."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    ttl = 0.5

    def worker(name: str) -> RedisStore:
        return RedisStore(redis_url, prefix=prefix, balance=False)

    with trio.fail_after(20):
        death = await die_mid_turn(worker("a"), worker_id="a", lease_ttl=ttl)
        await trio.sleep(ttl * 1.5)  # its lease lapses
        async with (
            sa.open_registry(store=worker("b"), agents=ECHO, worker_id="b", lease_ttl=ttl) as b,
            sa.open_registry(store=worker("c"), agents=ECHO, worker_id="c", lease_ttl=ttl) as c,
        ):
            state = await b.ref("s").state()  # wakes it on b
            assert (b.live(), c.live()) == (["s"], [])
            with pytest.raises(sa.EventsExpiredError) as caught:
                async with c.ref("s").subscribe(after=death.last):
                    pass
            assert_gone(caught.value, death, state)
