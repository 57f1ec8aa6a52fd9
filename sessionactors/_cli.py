"""The ``sessionactors`` command: ``demo`` (the main job), ``chat`` and ``serve``."""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence

import attrs
import trio

from ._agent import Agent
from ._events import Delta, TurnFinished
from ._registry import Registry, open_registry
from .stores._base import JournalEntry
from .stores._sqlite import SQLiteStore
from .testing._models import EchoModel

__all__ = ["main"]


def _rss_kib() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    except OSError:  # pragma: no cover - not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@attrs.define(eq=False)
class _FlakyStore(SQLiteStore):
    """A SQLite store whose next append for one chosen session fails (a simulated disk fault)."""

    fail_next: set[str] = attrs.field(factory=set)

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        if session_id in self.fail_next:
            self.fail_next.discard(session_id)
            raise OSError(f"simulated disk fault while writing session {session_id!r}")
        await super().append(session_id, entries, info, fence=fence)


def _say(text: str = "") -> None:
    print(text, flush=True)


async def _demo(path: str, sessions: int, turns: int) -> None:
    agent = Agent(model=EchoModel(), system_prompt="Repeat the user's words.")
    store = _FlakyStore(path)
    names = [f"chat-{i:04d}" for i in range(sessions)]

    _say(f"== sessionactors demo: {sessions} sessions on SQLite ({path})")
    async with open_registry(store=store, agents={"echo": agent}) as registry:
        gc.collect()
        rss0 = _rss_kib()
        t0 = time.perf_counter()
        for name in names:
            await registry.spawn(name, metadata={"tenant": "demo"})
        spawn_s = time.perf_counter() - t0
        gc.collect()
        per_session = (_rss_kib() - rss0) * 1024 / sessions
        _say(
            f"spawned {sessions} sessions in {spawn_s:.2f} s "
            f"({spawn_s / sessions * 1e6:.0f} us each, ~{per_session:.0f} bytes of RSS each)"
        )

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(_converse, registry, name, turns)
        elapsed = time.perf_counter() - t0
        total = sessions * turns
        _say(
            f"{total} durable turns across {sessions} concurrent conversations in "
            f"{elapsed:.2f} s: {total / elapsed:,.0f} turns/s"
        )

        await _stream_one(registry, names[0])
        await _two_viewers(registry, names[1])
        await _crash_and_recover(registry, store, names[2], names[3])

        expected = {name: len(await registry.ref(name).history()) for name in names}
        _say("closing the registry: every live session is hibernated to the store")

    async with open_registry(store=SQLiteStore(path), agents={"echo": agent}) as registry:
        intact = 0
        for name in names:
            if len(await registry.ref(name).history()) == expected[name]:
                intact += 1
        _say(f"reopened {path}: {intact}/{sessions} conversations resumed with their whole history")
        reply = await registry.ref(names[0]).send("Still here after a restart?")
        _say(f"{names[0]} answers after the restart: {reply.text!r}")
        if intact != sessions:
            raise SystemExit("some conversations did not resume intact")

    await _agents_that_act(path)


async def _agents_that_act(path: str) -> None:
    from ._agent import Compaction
    from ._records import Role, ToolCall
    from ._tools import Tool, tool
    from .testing._models import Scripted, ScriptedModel

    _say("\n-- an agent with tools: a lookup, then a refund that waits for a person")
    ran: list[str] = []

    @tool
    async def lookup_order(order_id: str) -> str:
        """Look up an order by its id."""
        ran.append(f"lookup_order({order_id})")
        return f"order {order_id}: delivered, 42.00 EUR"

    async def do_refund(order_id: str, amount: float) -> str:
        ran.append(f"refund({order_id}, {amount})")
        return f"refunded {amount:.2f} EUR on order {order_id}"

    refund = Tool(
        name="refund",
        fn=do_refund,
        description="Refund an order.",
        requires_review=True,
        idempotent=False,
    )
    model = ScriptedModel(
        [
            Scripted(
                tool_calls=[
                    ToolCall(id="c1", name="lookup_order", arguments='{"order_id": "A1001"}')
                ]
            ),
            Scripted(
                text="It was delivered; refunding it.",
                tool_calls=[
                    ToolCall(
                        id="c2", name="refund", arguments='{"order_id": "A1001", "amount": 42.0}'
                    )
                ],
            ),
            "Done: order A1001 is refunded.",
        ]
    )
    summarizer = ScriptedModel(["The user asked for a refund of order A1001; it was refunded."])
    agent = Agent(
        model=model,
        tools=[lookup_order, refund],
        compaction=Compaction(max_tokens=40, keep_last=2, summarizer=summarizer),
    )
    async with open_registry(store=SQLiteStore(path), agents={"shop": agent}) as registry:
        ref = await registry.spawn("refunds-1")
        reply = await ref.send("Refund order A1001, please.")
        review = reply.reviews[0]
        _say(f"   tools run so far: {ran}")
        _say(
            f"   the turn waits for review {review.id[:14]}... of {review.tool_call.name}"
            f"{review.tool_call.arguments}; closing the process"
        )
    async with open_registry(store=SQLiteStore(path), agents={"shop": agent}) as registry:
        pending = await registry.pending_reviews()
        _say(f"   after the restart, pending reviews: {[r.tool_call.name for r in pending]}")
        reply = await registry.ref("refunds-1").review(
            pending[0].id, approve=True, note="ok by Ada"
        )
        _say(f"   approved by Ada; the agent answers: {reply.text!r}")
        _say(f"   tools run: {ran} (the refund exactly once)")
        model.add("Anything else I can do?")
        ref = registry.ref("refunds-1")
        before = len(await ref.history())
        await ref.send("Thanks! That is all.")
        state = await ref.state()
        _say(
            f"   compaction: {before + 2} messages became {len(state.messages)} plus a "
            f"summary: {state.summary!r}"
        )
        roles = [m.role for m in state.messages]
        assert Role.TOOL not in roles[:1], "a tool result lost its call"


async def _converse(registry: Registry, name: str, turns: int) -> None:
    ref = registry.ref(name)
    for i in range(turns):
        reply = await ref.send(f"message {i} to {name}")
        if reply.text != f"message {i} to {name}":
            raise AssertionError(f"{name} got a misrouted reply: {reply.text!r}")


async def _stream_one(registry: Registry, name: str) -> None:
    _say(f"\n-- streaming one reply of {name} as it is produced:")
    ref = registry.ref(name)
    print("   ", end="")
    async with ref.stream("Streaming tokens one by one, as a chat UI would show them.") as events:
        async for event in events:
            if isinstance(event, Delta):
                print(event.text, end="", flush=True)
                await trio.sleep(0.02)
    _say()


async def _two_viewers(registry: Registry, name: str) -> None:
    _say(f"\n-- two viewers of {name}; viewer B disconnects mid-reply and resumes with after=")
    ref = registry.ref(name)
    text = "one two three four five six seven eight nine ten"
    seen_a: list[str] = []
    seen_b: list[str] = []
    b_first_part = trio.Event()
    b_resumed = trio.Event()
    last_b = 0

    async def viewer_a(task_status: trio.TaskStatus[None]) -> None:
        async with ref.subscribe() as events:
            task_status.started()
            async for event in events:
                if isinstance(event, Delta):
                    seen_a.append(event.text)
                if isinstance(event, TurnFinished):
                    return

    async def viewer_b(task_status: trio.TaskStatus[None]) -> None:
        nonlocal last_b
        async with ref.subscribe() as events:
            task_status.started()
            async for event in events:
                last_b = event.seq
                if isinstance(event, Delta):
                    seen_b.append(event.text)
                    if len(seen_b) == 4:
                        break  # the connection drops
        b_first_part.set()
        await b_resumed.wait()
        async with ref.subscribe(after=last_b) as events:
            async for event in events:
                if isinstance(event, Delta):
                    seen_b.append(event.text)
                if isinstance(event, TurnFinished):
                    return

    async with trio.open_nursery() as nursery:
        await nursery.start(viewer_a)
        await nursery.start(viewer_b)
        turn = await ref.submit(text)
        await b_first_part.wait()
        _say(f"   B dropped after seq {last_b} ({''.join(seen_b)!r}); reconnecting...")
        b_resumed.set()
        await turn.reply()
    _say(f"   A saw: {''.join(seen_a)!r}")
    _say(f"   B saw: {''.join(seen_b)!r}")
    _say(f"   identical, nothing lost or repeated: {seen_a == seen_b}")


async def _crash_and_recover(
    registry: Registry, store: _FlakyStore, victim: str, bystander: str
) -> None:
    from ._errors import SessionCrashedError

    _say(f"\n-- a store fault crashes {victim}'s actor; {bystander} never notices")
    before = registry.statistics().restarts
    store.fail_next.add(victim)
    victim_ref, other_ref = registry.ref(victim), registry.ref(bystander)
    try:
        await victim_ref.send("this write will fail")
    except SessionCrashedError as exc:
        _say(f"   {victim}'s caller got SessionCrashedError: {exc}")
    other = await other_ref.send("business as usual")
    _say(f"   {bystander} answered meanwhile: {other.text!r}")
    again = await victim_ref.send("and now?")
    restarts = registry.statistics().restarts - before
    _say(
        f"   {victim} was restarted from its durable state ({restarts} restart) "
        f"and answers: {again.text!r}"
    )


async def _chat(args: argparse.Namespace) -> None:
    from .models._openai import OpenAIChatModel

    model = OpenAIChatModel(base_url=args.base_url, model=args.model, api_key=args.api_key)
    agent = Agent(model=model, system_prompt=args.system_prompt)
    async with open_registry(store=SQLiteStore(args.db), agents={"chat": agent}) as registry:
        ref = await registry.get_or_spawn(args.session)
        history = await ref.history()
        _say(f"session {args.session!r} ({len(history)} messages so far); an empty line quits")
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line.strip():
                return
            async with ref.stream(line.strip()) as events:
                async for event in events:
                    if isinstance(event, Delta):
                        print(event.text, end="", flush=True)
            _say()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sessionactors")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job on the embedded SQLite store")
    demo.add_argument("--sessions", type=int, default=1000)
    demo.add_argument("--turns", type=int, default=3)
    demo.add_argument("--path", default=None, help="SQLite file (default: a temporary one)")
    sub.add_parser("demo-cluster", help="three workers on one local redis-server; one is killed")
    chat = sub.add_parser("chat", help="chat with an OpenAI-compatible server")
    chat.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    chat.add_argument("--model", required=True)
    chat.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    chat.add_argument("--session", default="chat")
    chat.add_argument("--db", default="sessionactors-chat.db", help="SQLite file")
    chat.add_argument("--system-prompt", default="You are a helpful assistant.")
    serve = sub.add_parser("serve", help="serve sessions over HTTP, with a chat page (extra http)")
    serve.add_argument("--store", required=True, help="sqlite:///path.db, memory:// or redis://...")
    serve.add_argument("--agent", required=True, help="MODULE:ATTRIBUTE: an Agent or a mapping")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN'")
    args = parser.parse_args(argv)
    if args.command == "serve":
        from .http._serve import main as serve_main

        raise SystemExit(serve_main(args))
    if args.command == "chat":
        trio.run(_chat, args)
        return
    if args.command == "demo-cluster":
        from ._cluster_demo import demo_cluster

        raise SystemExit(demo_cluster())
    if args.command == "demo":
        tmp = None
        path = args.path
        if path is None:
            tmp = tempfile.mkdtemp(prefix="sessionactors-demo-")
            path = os.path.join(tmp, "sessions.db")
        try:
            trio.run(_demo, path, args.sessions, args.turns)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    else:  # pragma: no cover
        parser.print_help(sys.stderr)
