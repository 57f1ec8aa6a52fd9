"""A session woken after an unclean stop (the process that ran it was killed in the
middle of a turn, or lost the session's lease) says so where an operator looks: one
WARNING naming the session, and a count in the registry's statistics and its
OpenTelemetry metrics. A clean wake, and a restart after a crash in the same process
(logged as the crash), say nothing of it."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from durability_checks import die_mid_turn
from otel_sdk import Otel
from processes import reap
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel, FaultyStore, crash

CHILD = Path(__file__).with_name("unclean_child.py")
ECHO = {"a": sa.Agent(model=EchoModel())}


def unclean(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "sessionactors" and "after an unclean stop" in r.getMessage()
    ]


async def first_line(process: trio.Process) -> str:
    assert process.stdout is not None
    data = b""
    while not data.endswith(b"\n"):
        chunk = await process.stdout.receive_some(1)
        if not chunk:
            assert process.stderr is not None
            raise AssertionError(f"the child ended early: {await process.stderr.receive_some()!r}")
        data += chunk
    return data.decode().strip()


async def test_a_wake_after_kill_9_mid_turn_warns_once_and_is_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, otel: Otel
) -> None:
    """A process on a SQLite file is killed (SIGKILL) while a turn streams; the next
    process, waking the session, logs one WARNING that names it and says that a turn
    under way then is lost (without the user's words), and counts it in
    ``statistics().unclean_wakes`` and ``sessionactors.sessions.unclean_wakes``; the
    session it had hibernated wakes without a word."""
    caplog.set_level(logging.INFO, logger="sessionactors")
    path = tmp_path / "kill.db"
    process = await trio.lowlevel.open_process(
        [sys.executable, str(CHILD), str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        with trio.fail_after(60):
            said = await first_line(process)
    finally:
        await reap(process)  # SIGKILL
    assert process.returncode == -signal.SIGKILL
    assert said.startswith("STREAMING "), said
    lost = said.split()[1]
    async with sa.open_registry(
        store=sa.SQLiteStore(path), agents=ECHO, telemetry=otel.telemetry
    ) as registry:
        with trio.fail_after(30):
            assert len(await registry.ref("t").history()) == 2  # hibernated: a clean wake
            assert unclean(caplog) == []
            state = await registry.ref("s").state()
            assert [m.content for m in state.messages] == ["one", "one"]
            assert (await registry.ref("s").turn_outcome(lost)).status is sa.TurnStatus.LOST
            await registry.ref("s").send("three")
            [record] = unclean(caplog)
            assert record.levelname == "WARNING"
            message = record.getMessage()
            assert "session 's'" in message
            assert "ref.turn_outcome" in message
            assert "private words" not in caplog.text
            statistics = registry.statistics()
            assert (statistics.unclean_wakes, statistics.woken) == (1, 2)
            [point] = otel.points("sessionactors.sessions.unclean_wakes")
            assert point.value == 1


async def test_a_restart_after_a_crash_in_the_same_process_is_no_unclean_wake(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A session that crashed (its store failed a write) and restarted from its durable
    state in the same process is logged as a crash and counted in ``restarts``, not
    again as a wake after an unclean stop."""
    caplog.set_level(logging.INFO, logger="sessionactors")
    store = FaultyStore(sa.SQLiteStore(tmp_path / "s.db"))
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(30):
            await ref.send("one")
            store.fail("append")
            with pytest.raises(sa.SessionCrashedError):
                await ref.send("two")
            await ref.send("three")
        assert registry.statistics().restarts == 1
        assert registry.statistics().unclean_wakes == 0
    assert unclean(caplog) == []
    assert "crashed and restarts" in caplog.text


@pytest.mark.redis
async def test_a_worker_that_wakes_a_session_of_a_dead_worker_warns_and_counts(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two workers on Redis: the one that wakes a session whose worker died in the
    middle of a turn logs the unclean stop once and counts it; the other says nothing."""
    caplog.set_level(logging.INFO, logger="sessionactors")
    prefix = f"sa-test:{uuid.uuid4().hex}"
    ttl = 0.5

    def store() -> RedisStore:
        return RedisStore(redis_url, prefix=prefix, balance=False)

    with trio.fail_after(30):
        death = await die_mid_turn(store(), worker_id="a", lease_ttl=ttl)
        caplog.clear()
        await trio.sleep(ttl * 1.5)  # its lease lapses
        async with (
            sa.open_registry(store=store(), agents=ECHO, worker_id="b", lease_ttl=ttl) as b,
            sa.open_registry(store=store(), agents=ECHO, worker_id="c", lease_ttl=ttl) as c,
        ):
            await b.ref("s").send("three")  # wakes it on b
            assert (await c.ref("s").turn_outcome(death.turn_id)).status is sa.TurnStatus.LOST
            assert (b.live(), c.live()) == (["s"], [])
            [record] = unclean(caplog)
            assert "session 's'" in record.getMessage()
            assert (b.statistics().unclean_wakes, c.statistics().unclean_wakes) == (1, 0)


async def test_many_unclean_wakes_in_a_short_time_are_a_bounded_number_of_lines(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, otel: Otel
) -> None:
    """After an outage stopped many sessions at once, the first ten that wake after
    their unclean stop are logged one WARNING each, the others in the next minute at
    DEBUG and then in one WARNING with their count and the first names; the next wake
    after that minute is logged whole again, and the statistics and the metric count
    every one."""
    caplog.set_level(logging.DEBUG, logger="sessionactors")
    store = sa.MemoryStore()
    names = [f"s{i:02}" for i in range(26)]
    with trio.CancelScope() as process:
        async with sa.open_registry(store=store, agents=ECHO) as registry:
            for name in names:
                await (await registry.spawn(name)).send("hello")
            crash(registry)
            process.cancel()
    async with sa.open_registry(store=store, agents=ECHO, telemetry=otel.telemetry) as registry:
        with trio.fail_after(600):
            for name in names[:25]:
                await registry.ref(name).state()
            warned = [r.getMessage() for r in unclean(caplog) if r.levelno == logging.WARNING]
            assert [line.split()[1] for line in warned] == [f"'{n}'" for n in names[:10]]
            await trio.sleep(61)  # the minute ends: one line tells the others
            warned = [r.getMessage() for r in unclean(caplog) if r.levelno == logging.WARNING]
            assert len(warned) == 11, warned
            summary = warned[-1]
            assert "15 more sessions" in summary, summary
            assert all(f"'{n}'" in summary for n in names[10:20]), summary
            assert all(f"'{n}'" not in summary for n in names[20:25]), summary
            assert "5 more" in summary, summary
            debug = [r.getMessage() for r in unclean(caplog) if r.levelno == logging.DEBUG]
            assert [line.split()[1] for line in debug] == [f"'{n}'" for n in names[10:25]]
            await registry.ref(names[25]).state()  # a new minute: told whole again
            last = unclean(caplog)[-1]
            assert (last.levelno, last.getMessage().split()[1]) == (logging.WARNING, "'s25'")
            assert registry.statistics().unclean_wakes == 26
            [point] = otel.points("sessionactors.sessions.unclean_wakes")
            assert point.value == 26


async def test_the_unclean_wakes_not_told_yet_are_told_when_the_registry_closes(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The wakes after an unclean stop logged at DEBUG only, whose minute has not ended
    when the registry closes, are told in their one WARNING as it closes."""
    caplog.set_level(logging.DEBUG, logger="sessionactors")
    store = sa.MemoryStore()
    names = [f"s{i:02}" for i in range(12)]
    with trio.CancelScope() as process:
        async with sa.open_registry(store=store, agents=ECHO) as registry:
            for name in names:
                await (await registry.spawn(name)).send("hello")
            crash(registry)
            process.cancel()
    with trio.fail_after(600):
        async with sa.open_registry(store=store, agents=ECHO) as registry:
            opened = trio.current_time()
            for name in names:
                await registry.ref(name).state()
            warned = [r.getMessage() for r in unclean(caplog) if r.levelno == logging.WARNING]
            assert len(warned) == 10, warned
        assert trio.current_time() - opened < 60  # (closed within the minute)
    warned = [r.getMessage() for r in unclean(caplog) if r.levelno == logging.WARNING]
    assert len(warned) == 11, warned
    summary = warned[-1]
    assert "2 more sessions" in summary, summary
    assert all(f"'{n}'" in summary for n in names[10:]), summary
