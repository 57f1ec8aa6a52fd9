"""Properties of the core runtime under interleavings that Hypothesis chooses."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors._actor import Actor
from sessionactors.testing import EchoModel

#: One submit of a caller: the pause before it, how it is made, and how long the reply is.
steps = st.tuples(
    st.integers(min_value=0, max_value=3),  # checkpoints before the submit
    st.sampled_from([0.0, 0.1, 0.25]),  # virtual seconds slept before the submit
    st.sampled_from(["submit", "send", "nowait"]),
    st.integers(min_value=0, max_value=3),  # extra words, so turns take several chunks
)
callers = st.lists(st.lists(steps, min_size=1, max_size=6), min_size=1, max_size=5)


async def play(plan: list[list[tuple[int, float, str, int]]], mailbox_size: int) -> None:
    agents = {"echo": sa.Agent(model=EchoModel(delay=0.1))}
    # Appended right before each request enters the mailbox, in the same trio step: a
    # ready session enqueues without yielding first and senders waiting for room are
    # admitted first come, first served, so this is the mailbox order.
    accepted: list[str] = []
    turns: dict[str, sa.Turn] = {}
    replies: dict[str, sa.Reply] = {}
    async with sa.open_registry(agents=agents, mailbox_size=mailbox_size) as registry:
        ref = await registry.spawn("prop")

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


class _LastInFirstOut:
    """A broken mailbox for the negative control: it serves the newest waiting request first."""

    def __init__(self, inner: trio.MemoryReceiveChannel[object]) -> None:
        self._inner = inner
        self._waiting: list[object] = []

    async def receive(self) -> object:
        if not self._waiting:
            self._waiting.append(await self._inner.receive())
        while True:
            try:
                self._waiting.append(self._inner.receive_nowait())
            except trio.WouldBlock:
                break
        return self._waiting.pop()

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_the_property_catches_turns_served_out_of_mailbox_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The property fails for a session that serves its mailbox newest first (negative control)."""
    original = Actor.__init__

    def broken_init(self: Actor, *args: Any) -> None:
        original(self, *args)
        self.receive = _LastInFirstOut(self.receive)  # type: ignore[assignment]

    monkeypatch.setattr(Actor, "__init__", broken_init)
    plan = [[(0, 0.0, "submit", 2)] * 3, [(0, 0.0, "submit", 0)] * 2]
    with pytest.raises(AssertionError, match="not whole turns in mailbox order"):
        trio.run(play, plan, 4, clock=trio.testing.MockClock(autojump_threshold=0))


def test_ids_are_unique_in_a_forked_child() -> None:
    """A forked child draws ids that its parent never does."""
    import os

    from sessionactors._records import new_id

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.write(write, "\n".join(new_id("msg") for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        child = set(f.read().split())
    parent = {new_id("msg") for _ in range(100)}
    assert len(child) == 100
    assert not child & parent
