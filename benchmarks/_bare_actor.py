"""A bare session actor: the guarantees benchmark 1's targets were set against, nothing more.

It is a reference for reading benchmark 1, not a design to use. What it keeps of
a session turn: a bounded FIFO mailbox (a trio memory channel), one turn at a
time, a reply slot the caller parks on once (no schedule point of its own on
the way in), numbered events (the turn's start with the user's message, each
delta, the outcome with the reply) as frozen attrs records in a replay ring,
history records with ids and times, turns inside a cancel scope, and with
``durable`` the reply only after the turn's events are packed with msgpack and
appended to a store that checkpoints (as ``MemoryStore.append`` does).

What it leaves out, and ``ref.send`` does per turn: the checks of the text, turn
ids that carry their session and time (``turn_outcome``), the queued-turn
bookkeeping, the status and its journaling, the session's info written with
every commit (listings), turn records, usage, the agent's request (system
prompt, tools), checks of what the model streams, telemetry and compaction
hooks, idempotency keys, reviews, subscriptions' lag handling and the ring's
byte bound, supervision (restart from the durable state), hibernation, and the
journal format that later versions can read (tagged maps, every field).
"""

from __future__ import annotations

import datetime
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import attrs
import msgpack
import outcome
import trio

_now = datetime.datetime.now
_UTC = datetime.UTC
_ids = itertools.count(1)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{next(_ids):08x}"


@attrs.frozen
class Message:
    id: str
    role: str
    content: str
    created_at: datetime.datetime


@attrs.frozen
class TurnStarted:
    seq: int
    turn_id: str
    message: Message


@attrs.frozen
class Delta:
    seq: int
    turn_id: str
    text: str


@attrs.frozen
class TurnFinished:
    seq: int
    turn_id: str
    message: Message


@attrs.frozen
class Reply:
    turn_id: str
    message: Message


class _Slot:
    """The reply slot: the caller parks in trio's wait, the actor reschedules it."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None

    def wait(self) -> Awaitable[Any]:
        self.task = trio.lowlevel.current_task()
        return trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)

    def set(self, value: object) -> None:
        if self.task is not None:
            trio.lowlevel.reschedule(self.task, outcome.Value(value))


class _Store:
    def __init__(self) -> None:
        self.journals: dict[str, list[tuple[int, bytes]]] = {}

    async def append(self, session_id: str, entries: list[tuple[int, bytes]]) -> None:
        await trio.lowlevel.checkpoint()
        self.journals.setdefault(session_id, []).extend(entries)


async def _instant_model(history: list[Message]) -> AsyncIterator[str]:
    yield "ok"


class BareActor:
    def __init__(self, name: str, store: _Store, *, durable: bool) -> None:
        self.name = name
        self._store = store
        self._durable = durable
        self._send, self._receive = trio.open_memory_channel[tuple[str, _Slot]](64)
        self._seq = 0
        self._ring: deque[object] = deque(maxlen=1000)
        self._history: list[Message] = []
        self._unsaved: list[TurnStarted | TurnFinished] = []
        self._pack = msgpack.Packer(datetime=True).pack
        self.scope = trio.CancelScope()  # cancels the turn in flight (and the actor)

    def send(self, text: str) -> Awaitable[Any]:
        """Queue a turn at once and return the wait for its reply."""
        slot = _Slot()
        self._send.send_nowait((text, slot))
        return slot.wait()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    async def run(self) -> None:
        with self.scope:
            async for text, slot in self._receive:
                turn_id = _new_id("turn")
                user = Message(_new_id("msg"), "user", text, _now(_UTC))
                started = TurnStarted(self._next(), turn_id, user)
                self._history.append(user)
                self._unsaved.append(started)
                self._ring.append(started)
                parts = []
                async for chunk in _instant_model(self._history):
                    parts.append(chunk)
                    self._ring.append(Delta(self._next(), turn_id, chunk))
                reply = Message(_new_id("msg"), "assistant", "".join(parts), _now(_UTC))
                finished = TurnFinished(self._next(), turn_id, reply)
                self._history.append(reply)
                self._unsaved.append(finished)
                if self._durable:
                    data = self._pack(
                        [
                            (
                                e.seq,
                                e.turn_id,
                                e.message.id,
                                e.message.content,
                                e.message.created_at,
                            )
                            for e in self._unsaved
                        ]
                    )
                    self._unsaved.clear()
                    await self._store.append(self.name, [(finished.seq, data)])
                self._ring.append(finished)
                slot.set(Reply(turn_id, reply))


def bare_actors(nursery: trio.Nursery, count: int, *, durable: bool) -> list[BareActor]:
    """``count`` bare actors on one store, running in ``nursery``."""
    store = _Store()
    actors = [BareActor(f"bare-{i}", store, durable=durable) for i in range(count)]
    for actor in actors:
        nursery.start_soon(actor.run)
    return actors
