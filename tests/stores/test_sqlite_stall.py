"""A SQLite file on a disk that stops answering (a frozen file system: a cloud volume's
stall, a hung network mount): writes block in the kernel. The registry's close stays
within its bounds all the same, and nothing acknowledged is lost.

The disk is a real one: an ext4 image, loop-mounted and frozen with ``fsfreeze``. That
needs root and a loop device; without them the test is skipped, saying so."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import JournalEntry, SQLiteStore
from sessionactors.testing import EchoModel

#: Real seconds after which the watchdog thaws the disk, whatever the test is doing.
THAW_AFTER = 20.0


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=30)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a file system of its own, which the test may freeze."""
    tools = ("mkfs.ext4", "mount", "umount", "fsfreeze")
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in tools):
        pytest.skip("a frozen disk needs root, mkfs.ext4, mount and fsfreeze")
    image, mountpoint = tmp_path / "disk.img", tmp_path / "disk"
    mountpoint.mkdir()
    with image.open("wb") as file:
        file.truncate(64 * 1024 * 1024)
    _run("mkfs.ext4", "-q", "-F", str(image))
    try:
        _run("mount", "-o", "loop,noatime", str(image), str(mountpoint))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"no loop device to mount a disk on: {exc.stderr.decode().strip()}")
    try:
        (mountpoint / "probe").touch()  # (a loop device may attach read-only)
    except OSError as exc:
        _run("umount", str(mountpoint))
        pytest.skip(f"the loop-mounted disk is not writable: {exc}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["fsfreeze", "-u", str(mountpoint)], capture_output=True)
        # (a store's thread that the frozen disk held finishes, and closes its file,
        # once the disk is back: the file system is busy until then)
        for _ in range(100):
            if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:  # (a store a failed test left open: detached once it closes)
            _run("umount", "-l", str(mountpoint))


async def test_a_write_the_frozen_disk_holds_gives_its_cancelled_caller_up_in_time(
    disk: Path,
) -> None:
    """A write that the thread runs as the disk freezes blocks in the kernel; its caller,
    cancelled, is given up after ``busy_timeout`` and 5 s (real time), not once the disk
    comes back. (Before, it waited for the thaw.)"""
    store = SQLiteStore(str(disk / "s.db"), busy_timeout=0.5)
    await store.create("s", b"snapshot", b"")
    done, thawed = _watchdog(disk)
    scope = trio.CancelScope()

    async def append() -> None:
        with scope:
            await store.append("s", [JournalEntry(1, b"entry")], b"")

    try:
        async with trio.open_nursery() as nursery:
            _run("fsfreeze", "-f", str(disk))
            nursery.start_soon(append)
            await trio.sleep(0.5)  # (real time: its thread runs it, blocked in the kernel)
            assert store.statistics().requests_queued == 0
            start = trio.current_time()
            scope.cancel()
    finally:
        done.set()
    waited = trio.current_time() - start
    assert not thawed.is_set(), "the cancelled write waited for the disk to come back"
    assert scope.cancelled_caught
    assert waited >= 5.5, waited  # (busy_timeout and 5 s: not given up before)
    subprocess.run(["fsfreeze", "-u", str(disk)], capture_output=True)
    with trio.fail_after(30):
        await store.aclose()


def _watchdog(disk: Path) -> tuple[threading.Event, threading.Event]:
    """(done, thawed): unless ``done`` is set within THAW_AFTER real seconds, the disk
    is thawed, and ``thawed`` set (the test's own bound: it never waits for ever)."""
    done, thawed = threading.Event(), threading.Event()

    def watch() -> None:
        if not done.wait(THAW_AFTER):
            subprocess.run(["fsfreeze", "-u", str(disk)], capture_output=True)
            thawed.set()

    threading.Thread(target=watch, daemon=True).start()
    return done, thawed


async def test_a_close_over_a_frozen_disk_stays_within_its_bounds(
    disk: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The disk freezes while a turn's write is in flight: its caller is not answered
    (the write's outcome is unknown), and the registry's close ends within its bounds
    (the grace, the frozen write's ``busy_timeout`` and 5 real seconds, then the write
    bounds), the caller getting ``SessionStoppedError``, not once the disk comes back;
    the turn acknowledged before is kept. (Before, the close waited on the frozen
    write until the disk thawed, and a SIGTERM with it.)"""
    path = disk / "s.db"
    done, thawed = _watchdog(disk)
    agents = {"a": sa.Agent(model=EchoModel())}
    outcomes: list[BaseException] = []

    async def send(ref: sa.SessionRef) -> None:
        try:
            await ref.send("frozen")
        except sa.SessionActorsError as exc:
            outcomes.append(exc)

    try:
        async with (
            trio.open_nursery() as nursery,
            sa.open_registry(
                store=sa.SQLiteStore(path, busy_timeout=1), agents=agents, shutdown_grace=1
            ) as registry,
        ):
            ref = await registry.spawn("s")
            assert (await ref.send("kept")).text == "kept"
            # (real time, as the store's thread runs: done with all before, and idle)
            await trio.to_thread.run_sync(time.sleep, 0.5)
            _run("fsfreeze", "-f", str(disk))
            nursery.start_soon(send, ref)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(60)  # (virtual: the write stays blocked in the kernel)
            assert outcomes == []
    finally:
        done.set()
    assert not thawed.is_set(), "the close waited for the disk to come back"
    [error] = outcomes
    assert isinstance(error, sa.SessionStoppedError), error
    subprocess.run(["fsfreeze", "-u", str(disk)], capture_output=True)
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        history = [m.content for m in await registry.ref("s").history()]
    assert history[:2] == ["kept", "kept"]
