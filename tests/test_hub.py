"""The hub on its own: seq numbering, the bounded replay ring, bounded subscribers."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors._hub import Hub, HubConfig
from sessionactors._subscription import EventIterator

SID = "hub-test"


def delta(hub: Hub, text: str = "x") -> sa.Delta:
    """A Delta carrying the hub's next seq."""
    return sa.Delta(session_id=SID, seq=hub.next_seq(), turn_id="turn_1", text=text)


def publish_deltas(hub: Hub, count: int, text: str = "x") -> None:
    for _ in range(count):
        hub.publish(delta(hub, text))


def ring_seqs(hub: Hub, after: int = 0) -> list[int]:
    return [e.seq for e in hub.ring_after(after)]


def drain(sub_receive: trio.MemoryReceiveChannel[sa.Event]) -> list[int]:
    seqs = []
    while True:
        try:
            seqs.append(sub_receive.receive_nowait().seq)
        except (trio.WouldBlock, trio.EndOfChannel):
            return seqs


# ---- seq ------------------------------------------------------------------------


def test_next_seq_counts_up_by_one_from_the_start_seq() -> None:
    """next_seq hands out consecutive seqs starting above the hub's initial seq."""
    hub = Hub(SID, HubConfig(), seq=41)
    assert [hub.next_seq() for _ in range(3)] == [42, 43, 44]


def test_advance_only_moves_seq_forward() -> None:
    """advance raises the seq to a higher value and ignores a lower one."""
    hub = Hub(SID, HubConfig())
    hub.advance(10)
    hub.advance(5)
    assert hub.seq == 10
    assert hub.next_seq() == 11


# ---- the replay ring --------------------------------------------------------------


def test_empty_hub_has_no_ring() -> None:
    """A hub that published nothing has no oldest seq and nothing to replay."""
    hub = Hub(SID, HubConfig())
    assert hub.oldest_seq is None
    assert hub.ring_after(0) == []
    assert hub.ring_covers(0)


def test_ring_is_bounded_by_event_count() -> None:
    """The ring keeps only the newest replay_events events."""
    hub = Hub(SID, HubConfig(replay_events=5))
    publish_deltas(hub, 12)
    assert ring_seqs(hub) == [8, 9, 10, 11, 12]
    assert hub.oldest_seq == 8


def test_ring_is_bounded_by_bytes() -> None:
    """The ring drops its oldest events once their estimated size passes replay_bytes."""
    # A Delta is estimated at 96 bytes plus its text: 100 bytes with a 4-character text.
    hub = Hub(SID, HubConfig(replay_events=1000, replay_bytes=350))
    publish_deltas(hub, 10, text="abcd")
    assert ring_seqs(hub) == [8, 9, 10]
    hub.publish(delta(hub, text="x" * 200))  # 296 bytes: only it fits
    assert ring_seqs(hub) == [11]


def test_event_larger_than_the_byte_bound_empties_the_ring() -> None:
    """An event bigger than replay_bytes is not kept, and the ring then covers nothing."""
    hub = Hub(SID, HubConfig(replay_bytes=200))
    publish_deltas(hub, 3)
    hub.publish(delta(hub, text="y" * 500))
    assert hub.oldest_seq is None
    assert not hub.ring_covers(3)
    assert hub.ring_covers(4)


def test_ring_covers_exactly_the_seqs_it_still_holds() -> None:
    """ring_covers(after) holds when every event after ``after`` is in the ring."""
    hub = Hub(SID, HubConfig(replay_events=5))
    publish_deltas(hub, 12)  # ring holds 8..12
    assert hub.ring_covers(7)
    assert hub.ring_covers(10)
    assert hub.ring_covers(12)
    assert hub.ring_covers(20)  # a seq not reached yet: nothing to replay
    assert not hub.ring_covers(6)
    assert not hub.ring_covers(0)


def test_ring_after_returns_the_later_events_in_order() -> None:
    """ring_after(after) is the ring's events with a larger seq, oldest first."""
    hub = Hub(SID, HubConfig(replay_events=5))
    publish_deltas(hub, 12)
    assert ring_seqs(hub, 9) == [10, 11, 12]
    assert ring_seqs(hub, 12) == []
    assert ring_seqs(hub, 0) == [8, 9, 10, 11, 12]


# ---- subscribers ------------------------------------------------------------------


def test_subscriber_receives_events_published_after_it_subscribed() -> None:
    """A subscriber gets every event published while it is subscribed, in order."""
    hub = Hub(SID, HubConfig())
    publish_deltas(hub, 2)
    sub = hub.subscribe()
    publish_deltas(hub, 3)
    assert drain(sub.receive) == [3, 4, 5]
    assert hub.subscriber_count == 1


def test_full_subscriber_is_evicted_without_blocking_the_others() -> None:
    """A subscriber whose buffer is full is ended as lagged while the others keep receiving."""
    hub = Hub(SID, HubConfig(subscriber_buffer=3))
    stuck = hub.subscribe()
    reader = hub.subscribe()
    for _ in range(3):
        hub.publish(delta(hub))
        reader.receive.receive_nowait()
    assert hub.subscriber_count == 2
    publish_deltas(hub, 2)  # publish is synchronous: it cannot wait for the stuck one
    assert stuck.lagged
    assert not reader.lagged
    assert hub.subscriber_count == 1
    assert drain(stuck.receive) == [1, 2, 3]
    assert drain(reader.receive) == [4, 5]


def test_subscriber_whose_reader_closed_is_dropped_quietly() -> None:
    """Publishing to a subscriber whose receiving end is closed drops it without a lag."""
    hub = Hub(SID, HubConfig())
    sub = hub.subscribe()
    sub.receive.close()
    publish_deltas(hub, 1)
    assert hub.subscriber_count == 0
    assert not sub.lagged


def test_unsubscribe_removes_the_subscriber() -> None:
    """unsubscribe removes a subscriber and closes both ends of its buffer."""
    hub = Hub(SID, HubConfig())
    sub = hub.subscribe()
    hub.unsubscribe(sub)
    assert hub.subscriber_count == 0
    publish_deltas(hub, 1)
    with pytest.raises(trio.ClosedResourceError):
        sub.receive.receive_nowait()


def test_close_ends_every_subscription_cleanly() -> None:
    """close ends each subscriber's stream after what it already has, without a lag."""
    hub = Hub(SID, HubConfig())
    subs = [hub.subscribe() for _ in range(3)]
    publish_deltas(hub, 2)
    hub.close()
    assert hub.subscriber_count == 0
    for sub in subs:
        assert not sub.lagged
        assert drain(sub.receive) == [1, 2]
        with pytest.raises(trio.EndOfChannel):
            sub.receive.receive_nowait()


# ---- the event iterator over a hub ----------------------------------------------------


def iterator(hub: Hub, after: int) -> EventIterator:
    sub = hub.subscribe()
    return EventIterator(SID, hub, sub, hub.ring_after(after), after, lambda: None)


async def test_iterator_replays_then_goes_live_without_duplicates() -> None:
    """An iterator replays the ring after its cursor, then continues with live events once."""
    hub = Hub(SID, HubConfig())
    publish_deltas(hub, 5)
    events = iterator(hub, 2)
    publish_deltas(hub, 2)
    seqs = []
    with trio.fail_after(5):
        for _ in range(5):
            seqs.append((await events.__anext__()).seq)
    assert seqs == [3, 4, 5, 6, 7]
    assert events.last_seq == 7


async def test_lagged_iterator_raises_with_the_last_seq_it_delivered() -> None:
    """An evicted iterator yields what it buffered, then SubscriberLaggedError with that seq."""
    hub = Hub(SID, HubConfig(subscriber_buffer=2))
    events = iterator(hub, 0)
    publish_deltas(hub, 4)
    with trio.fail_after(5):
        assert (await events.__anext__()).seq == 1
        assert (await events.__anext__()).seq == 2
        with pytest.raises(sa.SubscriberLaggedError) as info:
            await events.__anext__()
    assert info.value.last_seq == 2
    assert info.value.session_id == SID


async def test_cancelled_read_during_replay_loses_no_event() -> None:
    """A read cancelled during the replay delivers nothing, and the next read gets that event."""
    hub = Hub(SID, HubConfig())
    publish_deltas(hub, 3)
    events = iterator(hub, 0)
    with trio.CancelScope() as scope:
        scope.cancel()
        await events.__anext__()
    assert scope.cancelled_caught
    assert events.last_seq == 0
    with trio.fail_after(5):
        assert (await events.__anext__()).seq == 1


async def test_cancelled_live_read_loses_no_event(autojump_clock: trio.testing.MockClock) -> None:
    """A live read cancelled while waiting leaves the next event for the next read."""
    hub = Hub(SID, HubConfig())
    events = iterator(hub, 0)
    with trio.move_on_after(1):
        await events.__anext__()
    publish_deltas(hub, 1)
    with trio.fail_after(5):
        assert (await events.__anext__()).seq == 1
