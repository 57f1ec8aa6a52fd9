"""Properties of the core runtime under interleavings that Hypothesis chooses."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors.testing import EchoModel

#: One submit of a caller: the pause before it, how it is made, and how long the reply is.
steps = st.tuples(
    st.integers(min_value=0, max_value=3),  # checkpoints before the submit
    st.sampled_from([0.0, 0.1, 0.25]),  # virtual seconds slept before the submit
    st.sampled_from(["submit", "send", "nowait"]),
    st.integers(min_value=0, max_value=3),  # extra words, so turns take several chunks
)
callers = st.lists(st.lists(steps, min_size=1, max_size=6), min_size=1, max_size=5)


@asynccontextmanager
async def a_session(mailbox_size: int) -> AsyncIterator[Any]:
    """A session of a registry whose model echoes the user, taking 0.1 s a word."""
    agents = {"echo": sa.Agent(model=EchoModel(delay=0.1))}
    async with sa.open_registry(agents=agents, mailbox_size=mailbox_size) as registry:
        yield await registry.spawn("prop")


async def play(
    plan: list[list[tuple[int, float, str, int]]],
    mailbox_size: int,
    session: Callable[[int], AbstractAsyncContextManager[Any]] = a_session,
) -> None:
    # Appended right before each request enters the mailbox, in the same trio step: a
    # ready session enqueues without yielding first and senders waiting for room are
    # admitted first come, first served, so this is the mailbox order.
    accepted: list[str] = []
    turns: dict[str, sa.Turn] = {}
    replies: dict[str, sa.Reply] = {}
    async with session(mailbox_size) as ref:

        async def caller(index: int, my_steps: list[tuple[int, float, str, int]]) -> None:
            for k, (checkpoints, pause, how, words) in enumerate(my_steps):
                for _ in range(checkpoints):
                    await trio.lowlevel.checkpoint()
                if pause:
                    await trio.sleep(pause)
                text = " ".join([f"c{index}t{k}", *["w"] * words])
                if how == "nowait":
                    try:
                        turns[text] = ref.submit_nowait(text)
                    except sa.MailboxFullError:
                        how = "submit"
                    else:
                        accepted.append(text)
                        continue
                accepted.append(text)
                if how == "send":
                    replies[text] = await ref.send(text)
                else:
                    turns[text] = await ref.submit(text)
            for text, turn in list(turns.items()):
                if text.startswith(f"c{index}t"):
                    replies[text] = await turn.reply()

        with trio.fail_after(3600):
            async with trio.open_nursery() as nursery:
                for index, my_steps in enumerate(plan):
                    nursery.start_soon(caller, index, my_steps)
            history = await ref.history()

    submitted = sum(len(my_steps) for my_steps in plan)
    assert len(accepted) == len(set(accepted)) == len(replies) == submitted
    assert all(reply.text == text for text, reply in replies.items())
    assert len({reply.turn_id for reply in replies.values()}) == submitted
    # Whole turns, one after another, in mailbox order: each user message is followed at once
    # by its own reply, and every accepted turn is there exactly once.
    expected = [
        item for text in accepted for item in ((sa.Role.USER, text), (sa.Role.ASSISTANT, text))
    ]
    assert [(m.role, m.content) for m in history] == expected, "not whole turns in mailbox order"


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=callers, mailbox_size=st.integers(min_value=1, max_value=4))
def test_any_interleaving_of_submits_serializes_whole_turns(
    plan: list[list[tuple[int, float, str, int]]], mailbox_size: int
) -> None:
    """Any interleaving of submits from several callers yields a history that is a
    serialization of whole turns in mailbox order, each accepted turn exactly once."""
    trio.run(play, plan, mailbox_size, clock=trio.testing.MockClock(autojump_threshold=0))


@attrs.frozen
class _Reply:
    text: str
    turn_id: str


@attrs.define(eq=False)
class _Turn:
    text: str
    turn_id: str
    done: trio.Event = attrs.Factory(trio.Event)

    async def reply(self) -> _Reply:
        await self.done.wait()
        return _Reply(self.text, self.turn_id)


@attrs.define(eq=False)
class LastInFirstOut:
    """A session broken on purpose for the negative control: it serves the newest waiting
    request first. It has what ``play`` uses of a SessionRef."""

    send_channel: trio.MemorySendChannel[_Turn]
    receive_channel: trio.MemoryReceiveChannel[_Turn]
    messages: list[sa.Message] = attrs.Factory(list)
    count: int = 0

    def _turn(self, text: str) -> _Turn:
        self.count += 1
        return _Turn(text, f"turn_{self.count}")

    def submit_nowait(self, text: str) -> _Turn:
        turn = self._turn(text)
        try:
            self.send_channel.send_nowait(turn)
        except trio.WouldBlock:
            raise sa.MailboxFullError("full", session_id="prop") from None
        return turn

    async def submit(self, text: str) -> _Turn:
        turn = self._turn(text)
        await self.send_channel.send(turn)
        return turn

    async def send(self, text: str) -> _Reply:
        return await (await self.submit(text)).reply()

    async def history(self) -> list[sa.Message]:
        await trio.lowlevel.checkpoint()
        return list(self.messages)

    async def serve(self) -> None:
        waiting: list[_Turn] = []
        while True:
            if not waiting:
                waiting.append(await self.receive_channel.receive())
            while True:
                try:
                    waiting.append(self.receive_channel.receive_nowait())
                except trio.WouldBlock:
                    break
            turn = waiting.pop()  # the newest
            for _ in turn.text.split():
                await trio.sleep(0.1)
            self.messages += [
                sa.Message.create(sa.Role.USER, turn.text),
                sa.Message.create(sa.Role.ASSISTANT, turn.text),
            ]
            turn.done.set()


@asynccontextmanager
async def a_broken_session(mailbox_size: int) -> AsyncIterator[LastInFirstOut]:
    send_channel, receive_channel = trio.open_memory_channel[_Turn](mailbox_size)
    session = LastInFirstOut(send_channel, receive_channel)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.serve)
        yield session
        nursery.cancel_scope.cancel()


def test_the_property_catches_turns_served_out_of_mailbox_order() -> None:
    """The property fails for a session that serves its mailbox newest first (negative control)."""
    plan = [[(0, 0.0, "submit", 2)] * 3, [(0, 0.0, "submit", 0)] * 2]
    with pytest.raises(AssertionError, match="not whole turns in mailbox order"):
        trio.run(
            play, plan, 4, a_broken_session, clock=trio.testing.MockClock(autojump_threshold=0)
        )


async def ids_drawn() -> set[str]:
    """The turn and message ids of a few turns in a new registry."""
    ids: set[str] = set()
    async with sa.open_registry(agents={"echo": sa.Agent(model=EchoModel())}) as registry:
        ref = await registry.spawn("ids")
        for i in range(20):
            reply = await ref.send(f"turn {i}")
            ids |= {reply.turn_id, reply.message.id}
        ids |= {m.id for m in await ref.history()}
    return ids


def test_ids_are_unique_in_a_forked_child() -> None:
    """A forked child draws turn and message ids that its parent never does."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.write(write, "\n".join(trio.run(ids_drawn)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        child = set(f.read().split())
    parent = trio.run(ids_drawn)
    assert len(child) == len(parent) == 60
    assert not child & parent
