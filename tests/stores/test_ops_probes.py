"""Probes of a deployment whose disk misbehaves under a SQLite store: its file deleted
or replaced while a server uses it, its ``-wal``, ``-shm`` or lock file deleted, a
``-wal`` left behind by a deleted file, a file that this process may not write, a disk
that is full (stood in for by RLIMIT_FSIZE in a child process)."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import sessionactors as sa
import unusable_stores
from processes import unprivileged
from sessionactors.testing import EchoModel

ECHO = {"echo": sa.Agent(model=EchoModel())}


async def stored_texts(path: Path, name: str) -> list[str]:
    """The messages of session ``name`` in the file at ``path``, read as a tool would."""
    reader = sa.SQLiteStore(path, readonly=True)
    try:
        with trio.fail_after(10):
            state = await sa.read_session(reader, name)
    finally:
        await reader.aclose()
    return [m.content for m in state.messages]


def backup(source: Path, target: Path) -> None:
    """Copy the database at ``source`` to ``target`` with SQLite's backup, as docs say."""
    with sqlite3.connect(source) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
    src.close()
    dst.close()


def integrity(path: Path) -> str:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_store_whose_file_is_deleted_or_replaced_under_it_acknowledges_nothing(
    tmp_path: Path, how: str
) -> None:
    """A SQLite file deleted or replaced (by a copy, a restored backup) while a registry
    uses it: the store acknowledges no write to the file that is no longer at its path
    (a turn's caller gets SessionCrashedError caused by a StoreError that says so, a
    spawn the StoreError itself), and the file at the path, once the registry closed,
    holds none of the old file's writes."""
    path = tmp_path / "s.db"
    with trio.fail_after(30):
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            ref = await registry.spawn("a")
            await ref.send("before")
            if how == "deleted":
                path.unlink()
            else:  # a backup taken now, restored in place while the file is in use
                backup(path, tmp_path / "backup.db")
                path.rename(tmp_path / "old.db")
                (tmp_path / "backup.db").rename(path)
            with pytest.raises(sa.SessionCrashedError) as crashed:
                await ref.send("after")
            assert isinstance(crashed.value.__cause__, sa.StoreError)
            assert "deleted or replaced" in str(crashed.value.__cause__)
            with pytest.raises(sa.StoreError) as refused:
                await registry.spawn("b")
            assert "session 'b'" in str(refused.value)
            assert "deleted or replaced" in str(refused.value)
    if how == "deleted":
        # A store made at the path afterwards starts empty: nothing of the deleted file
        # (its -wal, left at the path) comes back into it.
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            assert await registry.sessions() == []
    else:
        assert await stored_texts(path, "a") == ["before", "before"]
        assert integrity(path) == "ok"
        assert await stored_texts(tmp_path / "old.db", "a") == ["before", "before"]


_KILLED_AFTER_WAL_DELETED = """
import os, signal, sys, trio
import sessionactors as sa
from sessionactors.testing import EchoModel

async def main():
    path = sys.argv[1]
    store = sa.SQLiteStore(path)
    async with sa.open_registry(store=store, agents={"echo": sa.Agent(model=EchoModel())}) as reg:
        ref = await reg.spawn("a")
        await ref.send("one")
        if sys.argv[2] == "quiet":  # the directory unchanged for a while (see below)
            await trio.sleep(2.1)
            await ref.send("quiet")
        os.unlink(path + "-wal")
        os.unlink(path + "-shm")
        for text in ("two", "three"):
            await ref.send(text)
            print(text, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

trio.run(main)
"""


@pytest.mark.parametrize("directory", ["changed", "quiet"])
async def test_turns_acknowledged_after_the_wal_was_deleted_survive_a_kill(
    tmp_path: Path, directory: str
) -> None:
    """Turns acknowledged after the store's -wal and -shm files were deleted under it are
    in the file after the process is killed (SIGKILL), not only in a deleted -wal that
    the process held open; also when the store's directory had not changed for a while
    before (the store then checks the files only once the directory's stamp changes:
    a real wait, as file time stamps do not follow trio's clock)."""
    path = tmp_path / "s.db"
    done = await trio.run_process(
        [sys.executable, "-c", _KILLED_AFTER_WAL_DELETED, str(path), directory],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert done.stdout.decode().split() == ["two", "three"]
    texts = [text for text in await stored_texts(path, "a") if text != "quiet"]
    assert texts == ["one", "one", "two", "two", "three", "three"]
    assert integrity(path) == "ok"


async def test_a_new_store_refuses_a_wal_left_behind_by_a_deleted_file(tmp_path: Path) -> None:
    """A -wal with writes in it at the path of a store file that does not exist (its
    file deleted, the -wal left) is refused with a StoreConfigurationError (no retry
    mends it) that names it and says what to do, instead of being read into the new
    file (where it brings back what was deleted, or corrupts the file)."""
    with trio.fail_after(30):
        async with sa.open_registry(store=sa.SQLiteStore(tmp_path / "s.db"), agents=ECHO) as reg:
            await (await reg.spawn("deleted-one")).send("hello")
            # (the registry is open, so the -wal holds the writes, not yet in the file)
            shutil.copy(tmp_path / "s.db-wal", tmp_path / "new.db-wal")
        path = tmp_path / "new.db"
        store = sa.SQLiteStore(path)
        try:
            with pytest.raises(sa.StoreConfigurationError) as refused:
                await store.list_sessions()
        finally:
            await store.aclose()
    message = str(refused.value)
    assert repr(str(path) + "-wal") in message
    assert "delete" in message
    assert not path.exists()
    # Once the -wal is gone, the store is made afresh, empty.
    (tmp_path / "new.db-wal").unlink()
    store = sa.SQLiteStore(path)
    try:
        assert await store.list_sessions() == []
    finally:
        await store.aclose()


_OPEN_WRITABLE = """
import sys, trio
import sessionactors as sa

async def main():
    try:
        async with sa.open_registry(store=sa.SQLiteStore(sys.argv[1])) as registry:
            print([info.session_id for info in await registry.sessions()])
    except sa.StoreError as exc:
        print(f"{type(exc).__name__}: {exc}")

trio.run(main)
"""


def run_unprivileged(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` as a process that file permissions apply to (root without
    the capability to override them)."""
    command = [*unprivileged(), sys.executable, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


async def test_a_writable_store_on_a_read_only_file_is_refused_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A SQLite file this process may not write, opened by a writable store, is refused
    at once with a StoreConfigurationError that says so and what to do, and leaves no
    -wal or -shm behind (files that, made read-only too, would still refuse the store
    once the file itself is made writable again)."""
    path = tmp_path / "s.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
        await (await registry.spawn("a")).send("hello")
    path.chmod(0o444)
    done = run_unprivileged("-c", _OPEN_WRITABLE, str(path))
    line = done.stdout.strip()
    assert line.startswith("StoreConfigurationError: "), (line, done.stderr)
    assert "read-only" in line
    assert "readonly=True" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.db"]
    path.chmod(0o644)
    done = run_unprivileged("-c", _OPEN_WRITABLE, str(path))
    assert done.stdout.strip() == "['a']", done.stdout + done.stderr


_THREE_CALLS = """
import sys, trio
import sessionactors as sa
from sessionactors.testing import EchoModel

async def main():
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(sys.argv[1]), agents=agents) as registry:
        calls = {
            "spawn": lambda: registry.spawn("new"),
            "send": lambda: registry.ref("old").send("hello"),
            "sessions": registry.sessions,
        }
        for call, run in calls.items():
            try:
                await run()
                print(call, "answered", sep="\t")
            except sa.SessionActorsError as exc:
                print(call, type(exc).__name__, exc.session_id, exc, sep="\t")

trio.run(main)
"""


@pytest.mark.parametrize("case", unusable_stores.CASES)
async def test_a_store_file_this_process_cannot_use_is_refused_at_once_and_untouched(
    tmp_path: Path, case: str
) -> None:
    """A registry on a SQLite file that is not a store (text, empty, another program's
    database), of a newer schema version, or that this process may not write (the file,
    its directory) answers spawn, a send to a stored session and a listing each with
    StoreConfigurationError (no retry fixes it), which names the session and the file
    and says what to do, and writes nothing."""
    unusable = await unusable_stores.make(tmp_path, case)
    before = unusable_stores.contents(tmp_path)
    launcher = unprivileged() if unusable.permissions else []
    try:
        done = subprocess.run(
            [*launcher, sys.executable, "-c", _THREE_CALLS, str(unusable.path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        unusable_stores.writable(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    answers = [line.split("\t") for line in done.stdout.splitlines()]
    assert [answer[0] for answer in answers] == ["spawn", "send", "sessions"], done.stdout
    for (call, kind, *told), session in zip(answers, ["new", "old", "None"], strict=True):
        assert kind == "StoreConfigurationError", (call, kind, told)
        assert told[0] == session, (call, told)
        message = told[1]
        assert repr(str(unusable.path)) in message, (call, message)
        for said in unusable.said:
            assert said in message, (call, said, message)
    assert unusable_stores.contents(tmp_path) == before


_SEND_FROM_ANOTHER_PROCESS = """
import sys, trio
import sessionactors as sa
from sessionactors.testing import EchoModel

async def main():
    agents = {"echo": sa.Agent(model=EchoModel())}
    try:
        async with sa.open_registry(store=sa.SQLiteStore(sys.argv[1]), agents=agents) as reg:
            await reg.ref("a").send("from another process")
            print("sent", flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # holds the store until told
    except sa.SessionActorsError as exc:
        print(f"{type(exc).__name__}: {exc}")

trio.run(main)
"""


@pytest.mark.parametrize("first", ["this process", "the other process"])
async def test_a_deleted_lock_file_does_not_let_a_second_process_write_beside_the_first(
    tmp_path: Path, first: str
) -> None:
    """The lock file of a store in use, deleted (by a clean-up of stale locks, say), is
    taken again by the store before its next transaction, so a second process that then
    opens the file is refused as it is while the lock is in place; a second process
    that came first holds the file, and this process's store then refuses to write."""
    path = tmp_path / "s.db"
    command = [sys.executable, "-c", _SEND_FROM_ANOTHER_PROCESS, str(path)]
    with trio.fail_after(60):
        async with sa.open_registry(store=sa.SQLiteStore(path), agents=ECHO) as registry:
            ref = await registry.spawn("a")
            await ref.send("one")
            Path(f"{path}.lock").unlink()
            if first == "this process":
                await ref.send("two")
            other = await trio.lowlevel.open_process(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            assert other.stdin is not None
            assert other.stdout is not None
            said = b""
            while not said.endswith(b"\n"):
                said += await other.stdout.receive_some()
            if first == "this process":
                assert said.startswith(b"StoreError: "), said
                assert b"in use by process" in said
                await ref.send("three")
                texts = ["one", "one", "two", "two", "three", "three"]
                assert [m.content for m in await ref.history()] == texts
            else:
                assert said == b"sent\n"
                with pytest.raises(sa.SessionCrashedError) as crashed:
                    await ref.send("two")
                assert "in use by process" in str(crashed.value.__cause__)
            await other.stdin.aclose()
            assert await other.wait() == 0


_FULL_AT_FIRST_OPEN = """
import os, resource, signal, sys, trio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
import sessionactors as sa

async def main():
    path = sys.argv[1]
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    said = []
    store = sa.SQLiteStore(path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # the disk is full
    try:
        await store.exists("x")
    except sa.StoreError as exc:
        said.append(f"full: {type(exc).__name__}")
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space is back
    try:
        said.append(f"then: {await store.exists('x')}")
    except sa.StoreError as exc:
        said.append(f"then: {exc}")
    await store.aclose()
    said.append(f"left: {sorted(os.listdir(os.path.dirname(path)))}")
    print("\\n".join(said))

trio.run(main)
"""


def test_a_store_first_opened_on_a_full_disk_works_once_space_is_back(tmp_path: Path) -> None:
    """A SQLite store whose first call meets a full disk (stood in for by a process whose
    files may not grow) fails that call with StoreError, and works once space is back,
    instead of taking its own lock, left held by the failed call, for another process's
    and refusing every call after; on close it leaves only the file."""
    done = subprocess.run(
        [sys.executable, "-c", _FULL_AT_FIRST_OPEN, str(tmp_path / "s.db")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["full: StoreError", "then: False", "left: ['s.db']"]


_WAL_DELETED_ON_A_FULL_DISK = """
import os, resource, signal, sys, trio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
from sessionactors import StoreError
from sessionactors.stores import JournalEntry, SQLiteStore

async def main():
    path = sys.argv[1]
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    store = SQLiteStore(path)
    await store.create("a", b"snapshot", b"info")
    await store.append("a", [JournalEntry(1, b"one" * 2000)], b"info")
    os.unlink(path + "-wal")
    os.unlink(path + "-shm")
    # the disk is full: what the deleted -wal holds cannot be written into the file yet
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), hard))
    said = []
    try:
        await store.append("a", [JournalEntry(2, b"two")], b"info")
    except StoreError:
        said.append("refused")
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space is back
    await store.append("a", [JournalEntry(3, b"three")], b"info")
    print(*said, "three", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

trio.run(main)
"""


async def test_a_deleted_wal_is_written_back_once_a_full_disk_has_room(tmp_path: Path) -> None:
    """What a deleted -wal holds is written into the file before the store goes on, and
    a full disk only puts that off: the connection, the only way to the deleted -wal's
    writes, is kept until they are in the file, so a kill afterwards loses nothing."""
    path = tmp_path / "s.db"
    done = await trio.run_process(
        [sys.executable, "-c", _WAL_DELETED_ON_A_FULL_DISK, str(path)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert done.stdout.decode().split() == ["refused", "three"]
    reader = sa.SQLiteStore(path, readonly=True)
    try:
        stored = await reader.load("a")
    finally:
        await reader.aclose()
    assert stored is not None
    assert [entry.seq for entry in stored.entries] == [1, 3]
