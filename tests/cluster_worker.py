"""A worker process for the cluster tests: one registry on a RedisStore, driven by JSON lines.

Usage: cluster_worker.py URL PREFIX WORKER_ID LEASE_TTL MODE WORD_DELAY [BALANCE]
or ``cluster_worker.py --spare``: import everything, then read those arguments as a JSON
list from the first stdin line (and exit at the end of input): a worker started ahead.

MODE is "normal"; "stale-write" (renewals report success without reaching the
store, as if they were stuck, so that only a fenced write can notice a lost
lease); "nofence" (stale-write, and writes drop their fencing token: broken
on purpose, a negative control); or "ack-early" (durability="hibernate": replies
before the turn is durable, another negative control); or "broken-claim" (a claim
that hands out a lease whoever holds it, and writes without a fencing token: a
negative control); or "lose-answer" (the first final answer to each request sent
to this worker is lost on the way: the requester is told it was heard, as when a
connection drops after the server counted its subscriber); or "lose-answers" (every
final answer is lost, copies too: a negative control for the recovery of
"lose-answer"). BALANCE is "balance" (the default: the workers share the shards
fairly) or "fixed" (``RedisStore(balance=False)``: a session stays where it woke).

Each stdin line is a command ``{"id": n, "op": ..., ...}``; the answer is one
stdout line ``{"id": n, ...}``. ``traffic`` also prints ``{"ack": ...}`` after
every reply. The first line printed is ``{"ready": WORKER_ID}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs
import msgpack
import trio

import sessionactors as sa
from sessionactors.stores import JournalEntry, Lease, RedisStore, load_events
from sessionactors.testing import EchoModel


class LoggingStore(RedisStore):
    """Records every write (start time, kind, user texts, outcome); optionally broken."""

    mode: str = "normal"
    writes: list[dict[str, Any]]

    def _fence(self, fence: int | None) -> int | None:
        return None if self.mode in ("nofence", "broken-claim") else fence

    async def _logged(self, kind: str, texts: list[str], write: Any) -> None:
        record: dict[str, Any] = {"t": time.monotonic(), "kind": kind, "texts": texts}
        self.writes.append(record)
        try:
            await write
        except BaseException as exc:
            record["error"] = type(exc).__name__
            raise
        record["error"] = None

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        texts = []
        for entry in entries:
            for event in load_events(entry.data):
                message = (
                    event.message if isinstance(event, sa.TurnStarted | sa.MessageAdded) else None
                )
                if message is not None and message.role is sa.Role.USER:
                    texts.append(message.content)
        write = super().append(session_id, entries, info, fence=self._fence(fence))
        await self._logged("append", texts, write)

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
        write = super().write_snapshot(
            session_id, snapshot, seq, info, trim_upto=trim_upto, fence=self._fence(fence)
        )
        await self._logged("snapshot", [], write)

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        lease = await super().claim(session_id, owner, ttl)
        if lease is None and self.mode == "broken-claim":  # another holds it: take it anyway
            return Lease(owner=owner, fence=0)
        return lease

    async def open_router(self, host: Any, nursery: trio.Nursery) -> Any:
        router = await super().open_router(host, nursery)
        if self.mode in ("lose-answer", "lose-answers"):
            transport = router.transport
            send = transport.send
            lost: set[str] = set()

            async def lossy(worker: str, incarnation: str, message: bytes) -> bool:
                body = msgpack.unpackb(message, timestamp=3)
                if body.get("ok") == "reply" and (
                    self.mode == "lose-answers" or body["re"] not in lost
                ):
                    lost.add(body["re"])
                    await trio.lowlevel.checkpoint()
                    return True  # "heard", then lost on the way
                return bool(await send(worker, incarnation, message))

            transport.send = lossy
            append_and_send = transport.append_and_send

            async def lossy_append(
                session_id: str,
                entries: Sequence[JournalEntry],
                info: bytes,
                fence: int | None,
                worker: str,
                incarnation: str,
                message: bytes,
            ) -> bool:
                # an answer sent with its turn's journal write is lost the same way
                body = msgpack.unpackb(message, timestamp=3)
                if body.get("ok") == "reply" and (
                    self.mode == "lose-answers" or body["re"] not in lost
                ):
                    lost.add(body["re"])
                    await self.append(session_id, entries, info, fence=fence)
                    return True  # "heard", then lost on the way
                return bool(
                    await append_and_send(
                        session_id, entries, info, fence, worker, incarnation, message
                    )
                )

            transport.append_and_send = lossy_append
        if self.mode == "lose-requests":  # every request this worker sends is lost
            transport = router.transport
            send_on = transport.send

            async def unheard(worker: str, incarnation: str, message: bytes) -> bool:
                if msgpack.unpackb(message, timestamp=3).get("op") in ("turn", "read", "call"):
                    await trio.lowlevel.checkpoint()
                    return True  # "heard", then lost on the way
                return bool(await send_on(worker, incarnation, message))

            transport.send = unheard
        return router

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        if self.mode in ("stale-write", "nofence", "broken-claim"):
            await trio.lowlevel.checkpoint()
            return True
        return await super().renew(session_id, lease, ttl)

    async def renew_many(self, leases: Mapping[str, Lease], ttl: float) -> set[str]:
        if self.mode in ("stale-write", "nofence", "broken-claim"):
            await trio.lowlevel.checkpoint()
            return set()
        return await super().renew_many(leases, ttl)


class EchoOrFail(EchoModel):
    """Echoes the user's words; raises ValueError when they start with "fail"; when
    they start with "review", first calls the tool "guarded" (which needs a review);
    when they start with "slow", first calls the tool "slow" (not idempotent: its
    start is journaled before it runs, for a hundred word delays)."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        last = next(m for m in reversed(request.messages) if m.role is sa.Role.USER)
        if last.content.startswith("fail"):
            await trio.lowlevel.checkpoint()
            raise ValueError(f"asked to fail: {last.content!r}")
        if last.content.startswith("review") and request.messages[-1] is last:
            await trio.lowlevel.checkpoint()
            yield sa.ToolCallChunk(0, id="call_guarded", name="guarded", arguments="{}")
            return
        if last.content.startswith("slow") and request.messages[-1] is last:
            await trio.lowlevel.checkpoint()
            yield sa.ToolCallChunk(0, id="call_slow", name="slow", arguments="{}")
            return
        async for chunk in super().stream(request):
            yield chunk


async def _guarded() -> str:
    """The tool of a "review" turn."""
    await trio.lowlevel.checkpoint()
    return "done"


def emit(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def error_of(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


async def lines() -> AsyncIterator[dict[str, Any]]:
    stream = trio.lowlevel.FdStream(os.dup(0))
    buffer = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


async def traffic(registry: sa.Registry, names: list[str], turns: int, tag: str) -> None:
    async def converse(name: str) -> None:
        ref = registry.ref(name)
        for i in range(turns):
            text = f"{tag}|{name}|{i}"
            for _attempt in range(20):
                try:
                    reply = await ref.send(text, idempotency_key=text)
                except sa.SessionActorsError as exc:
                    emit({"fail": text, **error_of(exc)})
                    await trio.sleep(0.05)
                    continue
                if reply.text != text:
                    emit({"fail": text, "error": "misrouted", "message": reply.text})
                emit({"ack": text, "name": name, "i": i, "tag": tag})
                break

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(converse, name)


async def serve(registry: sa.Registry, store: LoggingStore, nursery: trio.Nursery) -> None:
    async for cmd in lines():
        op = cmd["op"]
        rid = cmd.get("id")
        try:
            if op == "quit":
                emit({"id": rid, "ok": True})
                return
            if op == "spawn":  # spawned and woken here: this worker owns them
                for name in cmd["names"]:
                    await (await registry.get_or_spawn(name)).state()
                emit({"id": rid, "ok": True})
            elif op == "send":
                nursery.start_soon(send_one, registry, cmd)
            elif op == "start_turn":
                nursery.start_soon(start_turn, registry, cmd)
            elif op == "traffic":

                async def run_traffic(cmd: dict[str, Any] = cmd) -> None:
                    await traffic(registry, cmd["names"], cmd["turns"], cmd["tag"])
                    emit({"id": cmd["id"], "done": True})

                nursery.start_soon(run_traffic)
            elif op == "wake":
                nursery.start_soon(wake, registry, cmd)
            elif op == "hibernate":
                await registry.ref(cmd["name"]).hibernate()
                emit({"id": rid, "ok": True, "live": registry.live()})
            elif op == "live":
                emit({"id": rid, "live": registry.live()})
            elif op == "history":
                history = await registry.ref(cmd["name"]).history()
                emit({"id": rid, "messages": [[m.role.value, m.content] for m in history]})
            elif op == "writes":
                emit({"id": rid, "writes": store.writes})
            elif op == "stats":
                emit({"id": rid, **attrs.asdict(registry.statistics())})
            else:
                emit({"id": rid, "error": "ValueError", "message": f"unknown op {op!r}"})
        except Exception as exc:
            emit({"id": rid, **error_of(exc)})


async def send_one(registry: sa.Registry, cmd: dict[str, Any]) -> None:
    try:
        reply = await registry.ref(cmd["name"]).send(cmd["text"], idempotency_key=cmd.get("key"))
    except Exception as exc:
        emit({"id": cmd["id"], **error_of(exc)})
        return
    emit({"id": cmd["id"], "text": reply.text, "turn_id": reply.turn_id})


async def start_turn(registry: sa.Registry, cmd: dict[str, Any]) -> None:
    try:
        turn = await registry.ref(cmd["name"]).submit(cmd["text"])
    except Exception as exc:
        emit({"id": cmd["id"], **error_of(exc)})
        return
    emit({"id": cmd["id"], "turn_id": turn.id})
    try:
        reply = await turn.reply()
    except Exception as exc:
        emit({"outcome": turn.id, **error_of(exc)})
        return
    emit({"outcome": turn.id, "text": reply.text})


async def wake(registry: sa.Registry, cmd: dict[str, Any]) -> None:
    name = cmd["name"]
    try:
        history = await registry.ref(name).history()
    except Exception as exc:
        emit({"id": cmd["id"], **error_of(exc)})
        return
    emit({"id": cmd["id"], "live": name in registry.live(), "n": len(history)})


async def main(
    url: str, prefix: str, worker: str, ttl: float, mode: str, delay: float, balance: bool
) -> None:
    store = LoggingStore(url, prefix=prefix, balance=balance)
    store.mode = mode
    store.writes = []
    guarded = sa.Tool(name="guarded", fn=_guarded, requires_review=True)

    async def slow() -> str:
        await trio.sleep(100 * delay)
        return "done"

    tools = [guarded, sa.Tool(name="slow", fn=slow, idempotent=False)]
    agents = {"echo": sa.Agent(model=EchoOrFail(delay=delay), tools=tools)}
    durability = "hibernate" if mode == "ack-early" else "turn"
    async with sa.open_registry(
        store=store,
        agents=agents,
        lease_ttl=ttl,
        worker_id=worker,
        shutdown_grace=1.0,
        durability=durability,
    ) as registry:
        emit({"ready": worker})
        async with trio.open_nursery() as nursery:
            await serve(registry, store, nursery)
            nursery.cancel_scope.cancel()


def first_line() -> bytes:
    """The first stdin line, read byte by byte (what follows stays for ``lines()``)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            sys.exit(0)  # not needed after all
        line += byte
    return line


if __name__ == "__main__":
    args = json.loads(first_line()) if sys.argv[1:] == ["--spare"] else sys.argv[1:]
    url, prefix, worker, ttl, mode, delay = args[:6]
    balance = (args[6] if len(args) > 6 else "balance") == "balance"
    trio.run(main, url, prefix, worker, float(ttl), mode, float(delay), balance)
