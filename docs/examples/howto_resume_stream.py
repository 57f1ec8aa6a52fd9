"""How-to: resume a stream after a disconnect, without gaps or duplicates."""

import trio

import sessionactors as sa
from sessionactors.testing import EchoModel


async def read_until_finished(events, turn_id: str, seen: list[int]) -> None:
    async for event in events:
        seen.append(event.seq)
        if isinstance(event, sa.TurnFinished) and event.turn_id == turn_id:
            return


async def main() -> None:
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(agents={"echo": agent}, subscriber_buffer=4) as registry:
        ref = await registry.spawn("chat")
        seen: list[int] = []

        # 1. A client reads a few events, remembering the seq of the last one, and drops.
        async with ref.subscribe() as events:
            turn = await ref.submit("one two three four")
            async for event in events:
                seen.append(event.seq)
                if isinstance(event, sa.Delta):
                    break  # the connection is gone
        last_seq = seen[-1]

        # 2. It comes back: after=last_seq replays what it missed, then goes on live.
        async with ref.subscribe(after=last_seq) as events:
            await read_until_finished(events, turn.id, seen)
        print("resumed without gaps:", seen == list(range(seen[0], seen[-1] + 1)))

        # 3. A reader that falls behind its buffer (subscriber_buffer=4) is ended with
        #    SubscriberLaggedError; its last_seq says where to pick up.
        last_seq = seen[-1]
        async with ref.subscribe(after=last_seq) as events:
            turn = await ref.submit("a reply long enough to overflow a small buffer")
            await turn.reply()  # not reading meanwhile: the buffer fills up
            try:
                async for event in events:
                    seen.append(event.seq)
            except sa.SubscriberLaggedError as exc:
                print("lagged; last seq delivered:", exc.last_seq)
                last_seq = exc.last_seq
        async with ref.subscribe(after=last_seq) as events:
            await read_until_finished(events, turn.id, seen)
        print("caught up without gaps:", seen == list(range(seen[0], seen[-1] + 1)))

        # 4. Events too old to replay raise EventsExpiredError at subscribe time.
        #    Reload the state instead: its messages and its event_seq go together.
    async with sa.open_registry(
        agents={"echo": agent}, replay_events=4, journal_keep_events=4, snapshot_every=4
    ) as registry:
        ref = await registry.spawn("short-memory")
        for i in range(12):
            await ref.send(f"message {i}: " + "a long message " * 20)
        try:
            async with ref.subscribe(after=1):
                pass
        except sa.EventsExpiredError as exc:
            print("expired; oldest available seq:", exc.oldest_seq)
            state = await ref.state()
            print("reloaded", len(state.messages), "messages up to seq", state.event_seq)
            async with ref.subscribe(after=state.event_seq) as events:
                turn = await ref.submit("one more")
                fresh: list[int] = []
                await read_until_finished(events, turn.id, fresh)
            print("next event after the reload:", fresh[0] == state.event_seq + 1)


if __name__ == "__main__":
    trio.run(main)
