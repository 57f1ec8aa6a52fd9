"""The registry: names, lookup, supervision across many sessions, idle hibernation, shutdown."""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

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


def echo_step(request: sa.ModelRequest) -> str:
    """A scripted step that answers with the last message's text."""
    return request.messages[-1].content


# ---- scale and isolation ---------------------------------------------------------------


async def test_many_sessions_many_messages_lose_duplicate_and_misroute_nothing(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """1,000 sessions sent 10 messages each, all at once, answer every message exactly once,
    each with its own reply, in its own session."""
    names = [f"s{i}" for i in range(1000)]
    replies: dict[str, sa.Reply] = {}
    async with sa.open_registry(agents=echo_agents) as registry:
        refs = [await registry.spawn(name) for name in names]

        async def sender(ref: sa.SessionRef, text: str) -> None:
            replies[text] = await ref.send(text)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for ref in refs:
                    for j in range(10):
                        nursery.start_soon(sender, ref, f"{ref.session_id}/m{j}")
            histories = {ref.session_id: await ref.history() for ref in refs}
        stats = registry.statistics()

    assert len(replies) == 10_000
    assert all(reply.text == text for text, reply in replies.items())
    assert len({reply.turn_id for reply in replies.values()}) == 10_000
    for name, history in histories.items():
        turns = pairs(history)
        assert sorted(turns) == sorted((f"{name}/m{j}",) * 2 for j in range(10))
    assert (stats.turns_completed, stats.crashes) == (10_000, 0)


async def test_a_crash_in_one_of_many_sessions_touches_no_other(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """A crash in one of 1,000 sessions fails only its waiter with SessionCrashedError, restarts
    it from its last completed turn, and past the restart intensity marks it failed, while
    the other 999 answer and the registry stays open."""
    store = FaultyStore()
    names = [f"s{i}" for i in range(1000)]
    victim = "s500"
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        refs = {name: await registry.spawn(name) for name in names}
        replies: dict[str, sa.Reply] = {}
        crashed: list[sa.SessionCrashedError] = []

        async def sender(name: str, text: str) -> None:
            if name == victim:
                with pytest.raises(sa.SessionCrashedError) as info:
                    await refs[name].send(text)
                crashed.append(info.value)
            else:
                replies[name] = await refs[name].send(text)

        async def round_of_sends(text: str) -> None:
            replies.clear()
            async with trio.open_nursery() as nursery:
                for name in names:
                    nursery.start_soon(sender, name, f"{name} {text}")

        with trio.fail_after(60):
            for name in names:
                await refs[name].send(f"{name} first")
            store.fail("append", session_id=victim)
            await round_of_sends("second")
        assert len(crashed) == 1
        assert store.injected == 1  # negative control: the fault fired, once
        assert isinstance(crashed[0].__cause__, OSError)
        assert sorted(replies) == sorted(set(names) - {victim})
        assert all(reply.text == f"{name} second" for name, reply in replies.items())

        with trio.fail_after(60):
            # restarted from its last completed turn; it answers the next message
            assert pairs(await refs[victim].history()) == [(f"{victim} first",) * 2]
            assert (await refs[victim].send("third")).text == "third"
            assert (registry.statistics().crashes, registry.statistics().restarts) == (1, 1)

            await trio.sleep(6)  # let the first crash leave the restart window
            store.fail("append", session_id=victim, times=None)
            for _ in range(3):
                with pytest.raises(sa.SessionCrashedError, match="restarted"):
                    await refs[victim].send("crash")
            crashed.clear()
            await round_of_sends("fourth")  # the crash past the intensity, among the others
            assert len(crashed) == 1
            assert "marked failed" in str(crashed[0])
            assert len(replies) == 999
            with pytest.raises(sa.SessionCrashedError, match="marked failed"):
                await refs[victim].send("fails fast")
            with pytest.raises(sa.SessionCrashedError):
                refs[victim].submit_nowait("fails fast too")
            assert (await refs["s1"].send("still open")).text == "still open"
            infos = {info.session_id: info for info in await registry.sessions()}
        stats = registry.statistics()

    assert infos[victim].status is sa.Status.FAILED
    assert {info.status for name, info in infos.items() if name != victim} == {sa.Status.IDLE}
    assert (stats.crashes, stats.restarts, stats.failed, stats.failed_sessions) == (5, 4, 1, 1)
    assert victim not in registry.live()


# ---- shutdown -------------------------------------------------------------------------


async def test_a_registry_says_in_its_repr_once_it_is_closed(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """A registry kept after its block (a notebook's variable, an app's state) says it is
    closed when shown, as its next request's error does."""
    async with sa.open_registry(agents=echo_agents) as registry:
        await (await registry.spawn("s")).send("hi")
        assert repr(registry) == "<Registry live=1 store=MemoryStore>"
    assert repr(registry) == "<Registry live=0 store=MemoryStore closed>"


async def test_shutdown_lets_accepted_turns_finish_within_the_grace(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Leaving the registry block lets the turn in flight and the queued turns finish within
    shutdown_grace, then hibernates the sessions to the store."""
    store = MemoryStore()
    agents = {"slow": sa.Agent(model=EchoModel(delay=1.0))}
    with trio.fail_after(60):
        async with sa.open_registry(agents=agents, store=store, shutdown_grace=30) as registry:
            ref = await registry.spawn("g")
            turns = [await ref.submit(f"word{i} more") for i in range(5)]
            await trio.testing.wait_all_tasks_blocked()
            started = trio.current_time()
        assert trio.current_time() - started == pytest.approx(10)  # 5 turns x 2 words x 1 s
        assert registry.live() == []
        texts = [(await turn.reply()).text for turn in turns]

    assert texts == [f"word{i} more" for i in range(5)]
    async with sa.open_registry(agents=agents, store=store) as registry:
        with trio.fail_after(10):
            (info,) = await registry.sessions()
            history = await registry.ref("g").history()
    assert info.status is sa.Status.HIBERNATED
    assert pairs(history) == [(text, text) for text in texts]


@pytest.mark.parametrize("how", ["spawn", "get_or_spawn"])
async def test_a_spawn_that_the_close_overtakes_stores_nothing(tmp_path: Path, how: str) -> None:
    """A spawn (or get_or_spawn) whose close began while it waited for a read of the
    name to finish loading is refused with SessionStoppedError and stores nothing, as
    one begun after the close is."""
    stored = sa.SQLiteStore(tmp_path / "s.db")
    store = FaultyStore(stored)
    loading = store.hold("load", session_id="late")
    agents = {"echo": sa.Agent(model=EchoModel())}
    refused: list[BaseException] = []
    with trio.fail_after(30):
        async with (
            trio.open_nursery() as nursery,
            sa.open_registry(agents=agents, store=store) as registry,
        ):

            async def read() -> None:
                with pytest.raises(sa.SessionNotFoundError):
                    await registry.ref("late").history()

            async def spawn() -> None:
                try:
                    await getattr(registry, how)("late")
                except sa.SessionStoppedError as exc:
                    refused.append(exc)

            async def open_once_closing() -> None:
                await trio.testing.wait_all_tasks_blocked()  # the close waits on the read
                loading.open()

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert loading.waiting == 1
            nursery.start_soon(spawn)  # waits for the read's load
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(open_once_closing)
        assert len(refused) == 1, refused
        assert "closing" in str(refused[0]) or "closed" in str(refused[0])
        assert not await stored.exists("late")
        await stored.aclose()


async def test_shutdown_past_the_grace_fails_the_rest_and_stops_cleanly(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Past shutdown_grace the turn in flight is cut off, what is still queued fails with
    SessionStoppedError, and the registry stops cleanly and takes no new requests."""
    store = MemoryStore()
    never = trio.Event()
    model = ScriptedModel(
        [Scripted(text="quick"), Scripted(text="stuck forever", wait=never, wait_after=1)]
    )
    with trio.fail_after(60):
        async with sa.open_registry(
            agents={"m": sa.Agent(model=model)}, store=store, shutdown_grace=5
        ) as registry:
            ref = await registry.spawn("h")
            other = await registry.spawn("idle")
            quick = await ref.submit("quick")
            stuck = await ref.submit("stuck")
            queued = [await ref.submit(f"queued {i}") for i in range(3)]
            await trio.testing.wait_all_tasks_blocked()
            started = trio.current_time()
        assert trio.current_time() - started == pytest.approx(5)
        assert (await quick.reply()).text == "quick"
        with pytest.raises(sa.SessionStoppedError):
            await stuck.reply()
        for turn in queued:
            with pytest.raises(sa.SessionStoppedError):
                await turn.reply()
        with pytest.raises(sa.SessionStoppedError):
            await ref.send("after close")
        with pytest.raises(sa.SessionStoppedError):
            await other.send("after close")
        with pytest.raises(sa.SessionStoppedError):
            await registry.spawn("new")
        assert registry.live() == []

    async with sa.open_registry(agents={"m": sa.Agent(model=model)}, store=store) as registry:
        with trio.fail_after(10):
            history = await registry.ref("h").history()
    assert [(m.content, m.interrupted) for m in history] == [
        ("quick", False),
        ("quick", False),
        ("stuck", False),
        ("stuck", True),
    ]


# ---- names and lookup -----------------------------------------------------------------


async def test_spawn_refuses_a_live_or_stored_name(echo_agents: dict[str, sa.Agent]) -> None:
    """spawn raises SessionExistsError for a name that is live and for one that is only stored."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("taken")
            with pytest.raises(sa.SessionExistsError) as live:
                await registry.spawn("taken")
            await ref.send("hello")
            await ref.hibernate()
            assert registry.live() == []
            with pytest.raises(sa.SessionExistsError) as stored:
                await registry.spawn("taken")
            history = await ref.history()  # the stored session is untouched

    assert live.value.session_id == stored.value.session_id == "taken"
    assert "registry.ref('taken')" in str(live.value)
    assert "registry.ref('taken')" in str(stored.value)
    assert pairs(history) == [("hello", "hello")]


async def test_a_request_to_an_unknown_name_raises_not_found(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """registry.ref of an unknown name is a cheap handle, and its requests raise
    SessionNotFoundError, a LookupError, without creating the session."""
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = registry.ref("unknown")
        with trio.fail_after(10):
            with pytest.raises(sa.SessionNotFoundError) as info:
                await ref.send("hello?")
            with pytest.raises(LookupError):
                await ref.history()
            with pytest.raises(sa.SessionNotFoundError):
                await ref.state()
            with pytest.raises(sa.SessionNotFoundError):
                await registry.delete("unknown")
            sessions = await registry.sessions()

    assert info.value.session_id == "unknown"
    assert "unknown" in str(info.value)
    assert sessions == []
    assert registry.live() == []


async def test_get_or_spawn_spawns_once_and_then_finds(echo_agents: dict[str, sa.Agent]) -> None:
    """get_or_spawn spawns a missing session and returns the existing one, live or stored,
    leaving its state as it was."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.get_or_spawn("g", metadata={"tenant": "acme"})
            await ref.send("hi")
            again = await registry.get_or_spawn("g", metadata={"tenant": "other"})
            await ref.hibernate()
            stored = await registry.get_or_spawn("g", metadata={"tenant": "third"})
            state = await stored.state()

    assert again == ref == stored
    assert state.metadata == {"tenant": "acme"}
    assert pairs(state.messages) == [("hi", "hi")]
    assert registry.statistics().spawned == 1


async def test_get_or_spawn_refuses_bad_options_whether_or_not_the_session_exists(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """get_or_spawn checks system_prompt and metadata as spawn does, also for a session
    that exists, live or stored, whose own stay unchanged: bad input is refused with a
    TypeError or ValueError naming the session, whichever way the call would go."""
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"system_prompt": 5}, TypeError, "system_prompt"),
        ({"system_prompt": "p" * (1024 * 1024 + 1)}, ValueError, "system_prompt"),
        ({"system_prompt": "lone \ud800"}, ValueError, "system_prompt"),
        ({"metadata": ["tenant"]}, TypeError, "mapping"),
        ({"metadata": {"when": object()}}, TypeError, "when"),
        ({"metadata": {"score": math.nan}}, ValueError, "finite"),
        ({"metadata": {"blob": "x" * 70_000}}, ValueError, "over the limit"),
    ]
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("g", metadata={"tenant": "acme"})
            await ref.send("hi")
            for stored in (False, True):
                if stored:
                    await ref.hibernate()
                for options, error, pattern in bad:
                    for name in ("g", "new"):
                        with pytest.raises(error, match=pattern) as info:
                            await registry.get_or_spawn(name, **options)
                        assert repr(name) in str(info.value), str(info.value)
                assert registry.live() == ([] if stored else ["g"])
            assert [info.session_id for info in await registry.sessions()] == ["g"]
            state = await ref.state()
            assert (state.metadata, state.system_prompt) == ({"tenant": "acme"}, None)
            assert pairs(state.messages) == [("hi", "hi")]


async def test_live_sessions_and_statistics_describe_the_registry(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """live() lists running actors, sessions() describes every session live or stored,
    newest activity first, and statistics() counts what happened."""
    before = datetime.datetime.now(datetime.UTC)
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            fresh = await registry.spawn("a-fresh", metadata={"tenant": "acme"})
            talked = await registry.spawn("b-talked")
            sleeper = await registry.spawn("c-sleeper")
            await talked.send("one")
            await talked.send("two")
            await sleeper.send("zzz")
            await sleeper.hibernate()
            live = registry.live()
            infos = await registry.sessions()
            stats = registry.statistics()
            assert fresh.session_id not in live  # stored; its actor starts with a request

    assert sorted(live) == ["b-talked"]
    assert [i.session_id for i in infos] == ["c-sleeper", "b-talked", "a-fresh"]
    c, b, a = infos
    assert (a.agent, a.status, a.message_count, a.metadata) == (
        "echo",
        sa.Status.NEW,
        0,
        {"tenant": "acme"},
    )
    assert (b.status, b.message_count, b.metadata) == (sa.Status.IDLE, 4, {})
    assert (c.status, c.message_count) == (sa.Status.HIBERNATED, 2)
    assert all(before <= i.updated_at <= datetime.datetime.now(datetime.UTC) for i in infos)
    assert isinstance(stats, sa.RegistryStatistics)
    assert (stats.live, stats.spawned, stats.hibernated, stats.turns_completed) == (1, 3, 1, 3)
    assert (stats.crashes, stats.failed_sessions, stats.turns_failed) == (0, 0, 0)


async def test_spawn_needs_a_known_agent(echo_agents: dict[str, sa.Agent]) -> None:
    """spawn needs agent= when the registry has several agents and refuses an unknown one."""
    agents = {**echo_agents, "other": sa.Agent(model=EchoModel(prefix="other: "))}
    async with sa.open_registry(agents=agents) as registry:
        with trio.fail_after(10):
            with pytest.raises(ValueError, match="agent"):
                await registry.spawn("x")
            with pytest.raises(ValueError, match="nope"):
                await registry.spawn("x", agent="nope")
            ref = await registry.spawn("x", agent="other")
            reply = await ref.send("hi")
            sessions = await registry.sessions()

    assert reply.text == "other: hi"
    assert [i.agent for i in sessions] == ["other"]


# ---- delete ---------------------------------------------------------------------------------


async def test_delete_fails_pending_requests_and_frees_the_name(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """delete() fails the turn in flight and the queued ones with SessionNotFoundError, empties
    the store, and the name can be spawned afresh."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="held", wait=gate), echo_step], repeat=True)
    store = MemoryStore()
    async with sa.open_registry(agents={"m": sa.Agent(model=model)}, store=store) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("d")
            inflight = await ref.submit("held")
            queued = [await ref.submit(f"queued {i}") for i in range(2)]
            await trio.testing.wait_all_tasks_blocked()
            await registry.delete("d")
            for turn in [inflight, *queued]:
                with pytest.raises(sa.SessionNotFoundError):
                    await turn.reply()
            assert registry.live() == []
            assert await registry.sessions() == []
            assert await store.load("d") is None
            with pytest.raises(sa.SessionNotFoundError):
                await ref.send("gone")
            again = await registry.spawn("d")
            reply = await again.send("fresh start")
            history = await again.history()
            await registry.delete("d")
            with pytest.raises(sa.SessionNotFoundError):
                await registry.delete("d")
            assert await store.exists("d") is False

    assert reply.text == "fresh start"
    assert pairs(history) == [("fresh start", "fresh start")]


async def test_delete_removes_a_hibernated_session(echo_agents: dict[str, sa.Agent]) -> None:
    """delete() of a session that is only stored removes it from the store."""
    store = MemoryStore()
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("h")
            await ref.send("hello")
            await ref.hibernate()
            await registry.delete("h")
            assert await registry.sessions() == []
            assert await store.load("h") is None
            fresh = await registry.spawn("h")
            history = await fresh.history()

    assert history == []


@pytest.mark.parametrize("state", ["live", "hibernated"])
async def test_delete_ends_each_subscription_saying_the_session_was_deleted(
    echo_agents: dict[str, sa.Agent], state: str
) -> None:
    """delete() ends each subscription of the session (of a live one, and one replaying a
    hibernated one's journal) after the events it had with SessionNotFoundError naming
    the session and saying it was deleted, which a dropped connection never says."""
    seen: list[str] = []
    async with sa.open_registry(agents=echo_agents) as registry:

        async def follow() -> None:
            async with ref.subscribe(after=0) as events:
                async for event in events:
                    seen.append(type(event).__name__)
                    if isinstance(event, sa.TurnFinished):
                        await registry.delete("d")

        with trio.fail_after(10):
            ref = await registry.spawn("d")
            await ref.send("hello")
            if state == "hibernated":
                await ref.hibernate()
            with pytest.raises(sa.SessionNotFoundError) as ended:
                await follow()

    assert ended.value.session_id == "d"
    assert "session 'd' was deleted" in str(ended.value)
    assert "TurnFinished" in seen


async def test_delete_before_a_wake_begins_fails_the_queued_request(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """delete() right after a request woke a hibernated session fails that request with
    SessionNotFoundError instead of running it."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("w")
            await ref.send("hello")
            await ref.hibernate()
            queued = ref.submit_nowait("too late")  # wakes the session: its task is not running yet
            await registry.delete("w")
            with pytest.raises(sa.SessionNotFoundError):
                await queued.reply()
            assert await registry.sessions() == []


async def test_delete_during_a_wake_fails_everyone_waiting_for_it(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """delete() while a session is loading from the store fails the reads and turns waiting for
    the wake with SessionNotFoundError; none waits forever."""
    store = FaultyStore()
    outcomes: list[BaseException] = []
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("w")
            await ref.send("hello")
            await ref.hibernate()
            store.hold("load")  # never opened: the wake hangs in the store

            async def waiter(request: Callable[[], Awaitable[object]]) -> None:
                with pytest.raises(sa.SessionNotFoundError) as info:
                    await request()
                outcomes.append(info.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter, ref.history)
                nursery.start_soon(waiter, ref.state)
                nursery.start_soon(waiter, partial(ref.send, "blocked on the wake"))
                await trio.testing.wait_all_tasks_blocked()
                assert registry.live() == ["w"]
                await registry.delete("w")
            assert await registry.sessions() == []

    assert len(outcomes) == 3


# ---- idle hibernation -------------------------------------------------------------------


def test_an_idle_timeout_below_the_clocks_resolution_still_serves_every_request(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """An idle_timeout too small to move the clock's deadline (here, a clock far from its
    start) serves each request that waits in the mailbox before it hibernates, rather
    than hibernating again and again with the request unserved."""
    clock = trio.testing.MockClock(rate=1.0)  # real time (a livelock never blocks)...
    clock.jump(1e12)  # ...far from its start: a float this large steps by about 0.0001
    store = FaultyStore()

    async def main() -> None:
        async with sa.open_registry(store=store, agents=echo_agents, idle_timeout=1e-7) as registry:
            ref = await registry.spawn("brief")
            with trio.fail_after(10):
                for text in ("one", "two"):
                    assert (await ref.send(text)).text == text
                assert [m.content for m in await ref.history()] == ["one", "one", "two", "two"]

    trio.run(main, clock=clock)
    assert store.calls["write_snapshot"] < 10


async def test_idle_session_hibernates_and_wakes_with_its_history(
    echo_agents: dict[str, sa.Agent], autojump_clock: trio.abc.Clock
) -> None:
    """A session idle longer than idle_timeout hibernates, and the next message wakes it
    with its history."""
    async with sa.open_registry(agents=echo_agents, idle_timeout=60) as registry:
        with trio.fail_after(600):
            ref = await registry.spawn("sleepy")
            await ref.send("before")
            await trio.sleep(59)
            assert registry.live() == ["sleepy"]
            await trio.sleep(2)
            assert registry.live() == []
            (info,) = await registry.sessions()
            assert info.status is sa.Status.HIBERNATED
            reply = await ref.send("after")
            assert registry.live() == ["sleepy"]
            history = await ref.history()
        stats = registry.statistics()

    assert reply.text == "after"
    assert pairs(history) == [("before", "before"), ("after", "after")]
    # woken twice: by its first message after the spawn, and after the hibernation
    assert (stats.idle_hibernations, stats.hibernated, stats.woken) == (1, 1, 2)


async def test_open_registry_checks_its_options(echo_agents: dict[str, sa.Agent]) -> None:
    """open_registry refuses values that are not agents and out-of-range options before it
    opens."""
    bad: list[dict[str, object]] = [
        {"agents": echo_agents, "mailbox_size": 0},
        {"agents": echo_agents, "idle_timeout": 0},
        {"agents": echo_agents, "durability": "never"},
    ]
    for options in bad:
        with pytest.raises(ValueError):
            async with sa.open_registry(**options):  # type: ignore[arg-type]
                pass
    with pytest.raises(TypeError):
        async with sa.open_registry(agents={"x": EchoModel()}):  # type: ignore[dict-item]
            pass


@pytest.mark.parametrize("odd", ["\n", "\t", "\x00", "\u202e", "\u2028"])
async def test_open_registry_refuses_agent_names_and_worker_ids_with_control_characters(
    odd: str,
) -> None:
    """An agent's name or a worker id holding a control character (a newline, a tab,
    a right-to-left mark, a line separator), which session names refuse too, is refused
    at once with a ValueError naming the option and the character (they reach logs,
    JSON and keys); a zero-width joiner, part of emoji, is a name's as it is a session's."""
    echo = sa.Agent(model=EchoModel())
    with pytest.raises(
        ValueError, match=rf"agents\[.*\].*control character {re.escape(repr(odd))}"
    ):
        async with sa.open_registry(agents={f"chat{odd}bot": echo}):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match=rf"worker_id.*control character {re.escape(repr(odd))}"):
        async with sa.open_registry(worker_id=f"host{odd}1"):
            pass  # pragma: no cover
    async with sa.open_registry(agents={"\U0001f468\u200d\U0001f4bb": echo}, worker_id="w 1"):
        pass


async def test_open_registry_refuses_a_store_class_for_a_store() -> None:
    """A store's class given as store= (``sa.MemoryStore`` for ``sa.MemoryStore()``) is
    refused at once with a TypeError that says to make one, not an error of its
    methods called unbound as the registry closes."""
    for cls in (sa.MemoryStore, sa.SQLiteStore):
        with pytest.raises(TypeError, match=rf"{cls.__name__} is the class; make one"):
            async with sa.open_registry(store=cls):  # type: ignore[arg-type]
                pass


async def test_open_registry_refuses_a_url_or_path_as_store(tmp_path: Path) -> None:
    """A store URL or a file path in store= is refused at once with a TypeError that names
    the store to build (and the URL, with *** in place of its password), and no file is
    made."""
    path = tmp_path / "sessions.db"
    for store in (f"sqlite:///{path}", path, str(path)):
        with pytest.raises(TypeError, match=r"store must be a store such as sa.SQLiteStore"):
            async with sa.open_registry(store=store):  # type: ignore[arg-type]
                pass
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError) as raised:
        async with sa.open_registry(store="redis://ops:hunter2@127.0.0.1:6379/0"):  # type: ignore[arg-type]
            pass
    assert "hunter2" not in str(raised.value)
    assert "'redis://ops:***@127.0.0.1:6379/0' is a URL or a path" in str(raised.value)
    url = "redis://ops:hunter2@127.0.0.1:6379/0"
    for given, shown in [
        (url.encode(), "bytes 'redis://ops:***@127.0.0.1:6379/0'"),
        (b"redis://:hunter2\xff@h/0", "bytes 'redis://:***@h/0'"),
        (Path(url), f"{type(Path(url)).__name__} 'redis:/ops:***@127.0.0.1:6379/0'"),
    ]:
        with pytest.raises(TypeError) as raised:
            async with sa.open_registry(store=given):  # type: ignore[arg-type]
                pass
        assert "hunter2" not in str(raised.value)
        assert f"{shown} is a URL or a path" in str(raised.value)

    class HalfAStore:
        async def load(self, session_id: str) -> None:
            return None

    with pytest.raises(TypeError, match="HalfAStore lacks aclose, append, claim"):
        async with sa.open_registry(store=HalfAStore()):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("make", ["get_or_spawn", "spawn"])
async def test_a_read_of_a_name_not_stored_does_not_stand_in_for_it(
    echo_agents: dict[str, sa.Agent], make: str
) -> None:
    """A read of a session that does not exist starts an actor that finds nothing; while
    that load is in flight, a spawn of the name (or get_or_spawn, as the HTTP gateway
    does for a first message) creates the session and its first message is answered,
    not failed with SessionNotFoundError or refused as existing."""
    store = FaultyStore()
    with trio.fail_after(10):
        await _spawn_while_a_read_loads(echo_agents, store, make)


async def _spawn_while_a_read_loads(
    echo_agents: dict[str, sa.Agent], store: FaultyStore, make: str
) -> None:
    async with sa.open_registry(agents=echo_agents, store=store) as registry:
        gate = store.hold("load", session_id="web-1")
        read: list[BaseException] = []

        async def read_state() -> None:
            try:
                await registry.ref("web-1").state()
            except sa.SessionNotFoundError as exc:
                read.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_state)
            await trio.testing.wait_all_tasks_blocked()
            assert "web-1" in registry.live()  # its actor is loading, held at the gate
            make_it = registry.get_or_spawn if make == "get_or_spawn" else registry.spawn
            async with trio.open_nursery() as opener:
                opener.start_soon(_open_gate_soon, gate)
                ref = await make_it("web-1")
            reply = await ref.send("hello")
        assert reply.text == "hello"
        assert len(read) == 1  # the read itself found nothing: it began before the spawn
        assert pairs((await ref.state()).messages) == [("hello", "hello")]


async def _open_gate_soon(gate: Gate) -> None:
    await trio.testing.wait_all_tasks_blocked()
    gate.open()
