"""SQLiteStore keeps the store contract, durably, across runs and processes."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import sqlite3
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import sessionactors as sa
import unusable_stores
from sessionactors import SessionNotFoundError, SnapshotCorruptError, StoreError
from sessionactors.stores import MAX_SEQ, JournalEntry, SQLiteStore, Store, StoredSession
from sessionactors.testing import check_store
from stream_checks import read_until_it_ends

WORKER = Path(__file__).with_name("sqlite_claim_worker.py")
HOLDER = Path(__file__).with_name("sqlite_holder.py")


def _entries(*seqs: int) -> list[JournalEntry]:
    return [JournalEntry(seq, b"e-%d" % seq) for seq in seqs]


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sessionactors-sqlite")]


async def _wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.002)


async def test_sqlite_store_passes_check_store(tmp_path: Path) -> None:
    """SQLiteStore, on a fresh file for each store, passes the store conformance suite,
    what it acknowledged read through another SQLiteStore of the same file too."""
    counter = itertools.count()

    def reopen(store: Store) -> SQLiteStore:
        assert isinstance(store, SQLiteStore)
        return SQLiteStore(store.path)

    with trio.fail_after(60):
        await check_store(
            lambda: SQLiteStore(tmp_path / f"store-{next(counter)}.db"), reopen=reopen
        )
    assert not _worker_threads()


def test_init_does_no_io(tmp_path: Path) -> None:
    """Making a store touches no file and starts no thread."""
    store = SQLiteStore(tmp_path / "lazy.db")
    assert not (tmp_path / "lazy.db").exists()
    assert not _worker_threads()
    assert "lazy.db" in repr(store)


def test_bad_settings_are_refused() -> None:
    """An unknown synchronous setting or a negative busy_timeout raises ValueError."""
    with pytest.raises(ValueError, match="synchronous"):
        SQLiteStore("x.db", synchronous="SOMETIMES")
    with pytest.raises(ValueError, match="busy_timeout"):
        SQLiteStore("x.db", busy_timeout=-1)


async def test_store_reopens_after_aclose(tmp_path: Path) -> None:
    """A store used after aclose opens its file again, and a new store on the file sees the data."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    with trio.fail_after(10):
        await store.create("s", b"snap", b"info")
        await store.append("s", _entries(1, 2), b"info")
        await store.aclose()
        assert not _worker_threads()
        await store.append("s", _entries(3), b"info")
        await store.aclose()
        other = SQLiteStore(str(path))
        assert await other.load("s") == StoredSession(
            snapshot=b"snap", snapshot_seq=0, entries=tuple(_entries(1, 2, 3)), info=b"info"
        )
        await other.aclose()


async def test_a_store_opened_after_a_cancelled_aclose_writes_after_its_thread(
    tmp_path: Path,
) -> None:
    """After an aclose cancelled while its thread still has a write to do (another
    connection holds the write lock), the same store used again, or a new store of this
    process, is not refused as in use and writes after that thread's write, in the
    order the writes were made, rather than racing it (which refused the older one)."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    with trio.fail_after(10):
        await store.create("s", b"snap", b"info")
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            for old, seq in ((1, 2), (3, 4)):
                blocker.execute("BEGIN IMMEDIATE")  # (the store's next write waits for it)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(store.append, "s", _entries(old), b"info")
                    await trio.testing.wait_all_tasks_blocked()
                    with trio.CancelScope() as scope:
                        scope.cancel()  # (the close is queued behind the append, abandoned)
                        await store.aclose()
                    after = store if old == 1 else SQLiteStore(path)  # (again; a new one)
                    nursery.start_soon(after.append, "s", _entries(seq), b"info")
                    await trio.testing.wait_all_tasks_blocked()
                    blocker.execute("ROLLBACK")
        finally:
            blocker.close()
        assert (await after.load("s")).entries == tuple(_entries(1, 2, 3, 4))
        await store.aclose()
        await after.aclose()


def test_store_serves_successive_trio_runs(tmp_path: Path) -> None:
    """One store object, made outside any run, serves one trio.run after another."""
    store = SQLiteStore(tmp_path / "s.db")

    async def first() -> None:
        with trio.fail_after(10):
            await store.create("s", b"snap", b"info")
            await store.append("s", _entries(1), b"info")

    async def second() -> tuple[int, list[JournalEntry]]:
        with trio.fail_after(10):
            await store.append("s", _entries(2), b"info")
            journal = await store.read_journal("s", 0)
            await store.aclose()
            return journal

    trio.run(first)
    assert trio.run(second) == (0, _entries(1, 2))
    assert not _worker_threads()


async def statements_run_by(store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements the store runs on the connections it opens for one call (each
    connection sqlite3.connect makes meanwhile traces its statements)."""
    traced: list[str] = []
    connect = sqlite3.connect

    def tracing_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(traced.append)
        return conn

    with monkeypatch.context() as patch:
        patch.setattr(sqlite3, "connect", tracing_connect)
        try:
            await store.list_sessions()
        finally:
            await store.aclose()
    return traced


async def test_wal_and_full_synchronous_are_in_effect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is in WAL mode and the store's connection commits with synchronous=FULL
    (or the setting given)."""
    path = tmp_path / "s.db"
    with trio.fail_after(10):
        full = await statements_run_by(SQLiteStore(path), monkeypatch)
        assert "PRAGMA synchronous = FULL" in full
        relaxed = await statements_run_by(SQLiteStore(path, synchronous="normal"), monkeypatch)
        assert "PRAGMA synchronous = NORMAL" in relaxed
        assert "PRAGMA synchronous = FULL" not in relaxed
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


async def test_concurrent_appends_share_commits(tmp_path: Path) -> None:
    """Appends to many sessions at once are grouped into a few commits."""
    store = SQLiteStore(tmp_path / "s.db")
    names = [f"session-{i}" for i in range(200)]
    try:
        with trio.fail_after(20):
            for name in names:
                await store.create(name, b"snap", b"info")
            before = store.statistics()
            async with trio.open_nursery() as nursery:
                for name in names:
                    nursery.start_soon(store.append, name, _entries(1), b"info")
            after = store.statistics()
            assert after.appends - before.appends == len(names)
            assert after.commits - before.commits <= len(names) // 4
            assert after.largest_batch >= 20
            for name in names:
                assert await store.read_journal(name, 0) == (0, _entries(1))
    finally:
        await store.aclose()


async def _mixed_batch(path: Path) -> tuple[dict[str, BaseException | None], SQLiteStore]:
    """Five appends, two of them refused, queued to share one transaction."""
    store = SQLiteStore(path, busy_timeout=30)
    for name in ("good", "a", "b", "bad"):
        await store.create(name, b"snap", b"info")
    await store.append("bad", _entries(1), b"info")
    blocker = sqlite3.connect(path, isolation_level=None)
    started: set[str] = set()
    results: dict[str, BaseException | None] = {}

    async def run(label: str, call: Callable[[], object]) -> None:
        started.add(label)
        try:
            await call()  # type: ignore[misc]
        except Exception as exc:
            results[label] = exc
        else:
            results[label] = None

    try:
        with trio.fail_after(20):
            blocker.execute("BEGIN IMMEDIATE")  # holds the write lock: requests pile up
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "first", lambda: store.append("good", _entries(1), b"i"))
                await _wait_until(
                    lambda: "first" in started and store.statistics().requests_queued == 0
                )
                # These four queue up behind it, and will share the next transaction.
                nursery.start_soon(run, "stale", lambda: store.append("bad", _entries(1), b"i"))
                nursery.start_soon(run, "good-a", lambda: store.append("a", _entries(1), b"i"))
                nursery.start_soon(run, "missing", lambda: store.append("nope", _entries(1), b"i"))
                nursery.start_soon(run, "good-b", lambda: store.append("b", _entries(1), b"i"))
                await _wait_until(lambda: store.statistics().requests_queued == 4)
                blocker.execute("COMMIT")
    finally:
        blocker.close()
    return results, store


def _batch_problems(results: dict[str, BaseException | None]) -> list[str]:
    """What went wrong in _mixed_batch: a good append failed, or a bad one did not."""
    problems = [
        f"{label} failed: {results[label]!r}"
        for label in ("first", "good-a", "good-b")
        if results[label] is not None
    ]
    if not isinstance(results["stale"], StoreError) or isinstance(
        results["stale"], SessionNotFoundError
    ):
        problems.append(f"stale: {results['stale']!r}")
    if not isinstance(results["missing"], SessionNotFoundError):
        problems.append(f"missing: {results['missing']!r}")
    return problems


async def test_a_failing_request_does_not_fail_its_batch(tmp_path: Path) -> None:
    """Requests that fail in a shared transaction leave the others in it committed
    (the appends first try one statement for all, then run one by one)."""
    results, store = await _mixed_batch(tmp_path / "s.db")
    try:
        assert store.statistics().largest_batch >= 4
        assert _batch_problems(results) == []
        for name in ("good", "a", "b"):
            assert await store.read_journal(name, 0) == (0, _entries(1))
        assert await store.read_journal("bad", 0) == (0, _entries(1))
    finally:
        await store.aclose()


async def test_a_refused_append_among_many_after_other_writes_fails_alone(
    tmp_path: Path,
) -> None:
    """Appends grouped after another write of the same transaction (a create): one of
    them refused fails alone; the create and the other appends commit."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path, busy_timeout=30)
    names = [f"s{i}" for i in range(30)]
    blocker: sqlite3.Connection | None = None
    results: dict[str, BaseException | None] = {}
    started: set[str] = set()

    async def run(label: str, call: Callable[[], Any]) -> None:
        started.add(label)
        try:
            await call()
        except Exception as exc:
            results[label] = exc
        else:
            results[label] = None

    try:
        with trio.fail_after(30):
            for name in [*names, "stale", "pilot"]:
                await store.create(name, b"snap", b"info")
            await store.append("stale", _entries(1), b"info")
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")  # holds the write lock: requests pile up
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "pilot", lambda: store.append("pilot", _entries(1), b"i"))
                await _wait_until(
                    lambda: "pilot" in started and store.statistics().requests_queued == 0
                )
                assert "pilot" not in results  # it waits for the lock
                nursery.start_soon(run, "new", lambda: store.create("new", b"snap", b"info"))
                await _wait_until(lambda: store.statistics().requests_queued == 1)
                for name in names[:15]:
                    nursery.start_soon(run, name, partial(store.append, name, _entries(1), b"i"))
                await _wait_until(lambda: store.statistics().requests_queued == 16)
                nursery.start_soon(run, "stale", lambda: store.append("stale", _entries(1), b"i"))
                await _wait_until(lambda: store.statistics().requests_queued == 17)
                for name in names[15:]:
                    nursery.start_soon(run, name, partial(store.append, name, _entries(1), b"i"))
                await _wait_until(lambda: store.statistics().requests_queued == 32)
                blocker.execute("COMMIT")
        assert store.statistics().largest_batch >= 32
        failed = {label: exc for label, exc in results.items() if exc is not None}
        assert list(failed) == ["stale"], failed
        assert isinstance(failed["stale"], StoreError)
        assert not isinstance(failed["stale"], SessionNotFoundError)
        assert failed["stale"].session_id == "stale"
        assert await store.exists("new")
        for name in ["pilot", *names]:
            assert await store.read_journal(name, 0) == (0, _entries(1))
        assert await store.read_journal("stale", 0) == (0, _entries(1))
    finally:
        if blocker is not None:
            blocker.close()
        await store.aclose()


async def test_an_append_of_data_that_is_not_bytes_fails_alone(tmp_path: Path) -> None:
    """An entry whose data is no bytes-like object fails its own append with TypeError,
    and the appends queued with it commit."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path, busy_timeout=30)
    results: dict[str, BaseException | None] = {}

    async def run(label: str, entries: list[JournalEntry]) -> None:
        try:
            await store.append(label, entries, b"i")
        except Exception as exc:
            results[label] = exc
        else:
            results[label] = None

    blocker: sqlite3.Connection | None = None
    try:
        with trio.fail_after(30):
            for name in ("pilot", "a", "b", "bad"):
                await store.create(name, b"snap", b"info")
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")  # holds the write lock: requests pile up
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "pilot", _entries(1))
                await _wait_until(lambda: store.statistics().requests_queued == 0)
                await trio.sleep(0.05)  # (the pilot waits for the lock)
                nursery.start_soon(run, "a", _entries(1))
                nursery.start_soon(run, "b", _entries(1))
                await _wait_until(lambda: store.statistics().requests_queued == 2)
                nursery.start_soon(run, "bad", [JournalEntry(1, None)])  # type: ignore[arg-type]
                await trio.sleep(0.05)
                blocker.execute("COMMIT")
        assert isinstance(results.pop("bad"), TypeError)
        assert results == {"pilot": None, "a": None, "b": None}
        assert await store.read_journal("bad", 0) == (0, [])
        assert await store.read_journal("b", 0) == (0, _entries(1))
    finally:
        if blocker is not None:
            blocker.close()
        await store.aclose()


async def test_two_appends_of_one_session_in_one_transaction_commit_in_order(
    tmp_path: Path,
) -> None:
    """Appends of one session queued into one transaction, beside another session's,
    all commit, each checked against the seq the one before it stored."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path, busy_timeout=30)
    blocker: sqlite3.Connection | None = None
    started: list[str] = []

    async def pilot() -> None:
        started.append("pilot")
        await store.append("pilot", _entries(1), b"i")

    try:
        with trio.fail_after(30):
            for name in ("pilot", "a", "b"):
                await store.create(name, b"snap", b"info")
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")  # holds the write lock: requests pile up
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pilot)
                await _wait_until(lambda: started and store.statistics().requests_queued == 0)
                nursery.start_soon(store.append, "a", _entries(1), b"i")
                await _wait_until(lambda: store.statistics().requests_queued == 1)
                nursery.start_soon(store.append, "b", _entries(1), b"i")
                await _wait_until(lambda: store.statistics().requests_queued == 2)
                nursery.start_soon(store.append, "a", _entries(2, 3), b"i")
                await _wait_until(lambda: store.statistics().requests_queued == 3)
                blocker.execute("COMMIT")
        assert store.statistics().largest_batch >= 3
        assert await store.read_journal("a", 0) == (0, _entries(1, 2, 3))
        assert await store.read_journal("b", 0) == (0, _entries(1))
    finally:
        if blocker is not None:
            blocker.close()
        await store.aclose()


def test_the_batch_check_catches_a_batch_that_fails_together() -> None:
    """Negative control: results where one refused append failed the others, under its
    name, as a whole-transaction failure once did, are reported as problems."""
    stale = StoreError("session 'bad': seq 1 is not above 1", session_id="bad")
    together: dict[str, BaseException | None] = {
        "first": None,
        "stale": stale,
        "good-a": stale,
        "missing": SessionNotFoundError("session 'nope' is not stored", session_id="nope"),
        "good-b": stale,
    }
    assert _batch_problems(together) == [f"good-a failed: {stale!r}", f"good-b failed: {stale!r}"]


async def test_cancelled_append_is_all_or_nothing(tmp_path: Path) -> None:
    """A cancelled append raises Cancelled: if queued it never runs, if in flight it completes."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path, busy_timeout=30)
    await store.create("in-flight", b"snap", b"info")
    await store.create("queued", b"snap", b"info")
    blocker = sqlite3.connect(path, isolation_level=None)
    scopes: dict[str, trio.CancelScope] = {}
    caught: dict[str, bool] = {}

    async def append(name: str) -> None:
        with trio.CancelScope() as scope:
            scopes[name] = scope
            await store.append(name, _entries(1), b"info")
        caught[name] = scope.cancelled_caught

    try:
        with trio.fail_after(20):
            blocker.execute("BEGIN IMMEDIATE")  # the in-flight append waits for this lock
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append, "in-flight")
                await _wait_until(
                    lambda: "in-flight" in scopes and store.statistics().requests_queued == 0
                )
                nursery.start_soon(append, "queued")
                await _wait_until(lambda: store.statistics().requests_queued == 1)
                scopes["in-flight"].cancel()
                scopes["queued"].cancel()
                await _wait_until(lambda: "queued" in caught)
                assert store.statistics().requests_queued == 0
                assert "in-flight" not in caught  # still waiting for its transaction
                blocker.execute("COMMIT")
        assert caught == {"in-flight": True, "queued": True}
        assert await store.read_journal("in-flight", 0) == (0, _entries(1))
        assert await store.read_journal("queued", 0) == (0, [])
        await store.append("queued", _entries(1), b"info")
        with pytest.raises(StoreError, match="not above"):
            await store.append("in-flight", _entries(1), b"info")
    finally:
        blocker.close()
        await store.aclose()
    assert not _worker_threads()


async def test_an_idle_store_keeps_nothing_it_wrote(tmp_path: Path) -> None:
    """Once an append is answered, the store keeps none of its data (its thread kept
    its last batch, data included, until the next one came)."""
    store = SQLiteStore(tmp_path / "s.db")
    tracemalloc.start()
    try:
        with trio.fail_after(10):
            await store.create("s", b"snap", b"info")
            before = tracemalloc.get_traced_memory()[0]
            entries = [JournalEntry(seq, b"%d" % seq * (1 << 20)) for seq in (1, 2, 3, 4)]
            await store.append("s", entries, b"i")
            held = tracemalloc.get_traced_memory()[0] - before
            assert held > 4 << 20  # (what is measured: the data, alive)
            del entries
            with trio.move_on_after(2):
                while held > 1 << 20:
                    await trio.sleep(0.01)
                    gc.collect()
                    held = tracemalloc.get_traced_memory()[0] - before
            assert held < 1 << 20, f"{held:,} bytes still held after the append"
    finally:
        tracemalloc.stop()
        await store.aclose()


def test_dropped_store_stops_its_thread(tmp_path: Path) -> None:
    """A store dropped without aclose stops its thread and closes its file."""

    async def use() -> None:
        store = SQLiteStore(tmp_path / "s.db")
        with trio.fail_after(10):
            await store.create("s", b"snap", b"info")

    trio.run(use)
    gc.collect()
    for thread in _worker_threads():
        thread.join(timeout=10)
    assert not _worker_threads()


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
@pytest.mark.parametrize(
    "where", ["missing directory", "file as directory", "directory", "NUL", "symlink loop"]
)
async def test_a_path_no_retry_can_open_raises_store_configuration_error(
    tmp_path: Path, where: str, readonly: bool
) -> None:
    """A path in a directory that does not exist (or under a file), a path that is a
    directory, one that holds a NUL character or is a loop of symbolic links, fails
    the call with StoreConfigurationError (no retry can open it) that names the
    session and the path or its directory and says what to do, and creates nothing."""
    (tmp_path / "a-file").write_bytes(b"")
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "a-directory" / "loop-1").symlink_to(tmp_path / "a-directory" / "loop-2")
    (tmp_path / "a-directory" / "loop-2").symlink_to(tmp_path / "a-directory" / "loop-1")
    loop = tmp_path / "a-directory" / "loop-1"
    path, named, said = {
        "NUL": (f"{tmp_path}/s\x00.db", f"{tmp_path}/s\x00.db", "holds a NUL character"),
        "symlink loop": (loop, loop, "is a loop of symbolic links"),
        "missing directory": (tmp_path / "no-such-dir" / "s.db", tmp_path / "no-such-dir",
                              "does not exist: create it, or correct the store's path"),
        "file as directory": (tmp_path / "a-file" / "s.db", tmp_path / "a-file",
                              "is not a directory: correct the store's path"),
        "directory": (tmp_path / "a-directory", tmp_path / "a-directory",
                      "is a directory, not a SQLite file"),
    }[where]  # fmt: skip
    store = SQLiteStore(path, readonly=readonly)
    with trio.fail_after(10), pytest.raises(sa.StoreConfigurationError) as info:
        await store.load("s")
    assert info.value.session_id == "s"
    assert str(info.value).startswith("session 's': "), info.value
    assert repr(str(named)) in str(info.value), info.value
    assert said in str(info.value), info.value
    await store.aclose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-directory", "a-file"]
    assert sorted(p.name for p in (tmp_path / "a-directory").iterdir()) == ["loop-1", "loop-2"]


async def test_unopenable_file_raises_store_error(tmp_path: Path) -> None:
    """A file that cannot be opened fails the call with StoreError naming the path."""
    path = tmp_path / "s.db"
    path.write_bytes(b"x" * 4096)  # not an SQLite database
    store = SQLiteStore(path)
    with trio.fail_after(10), pytest.raises(StoreError, match=r"s\.db") as info:
        await store.create("s", b"snap", b"info")
    assert info.value.session_id == "s"
    assert isinstance(info.value.__cause__, OSError | sqlite3.Error)
    await store.aclose()


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    """A file written by a newer schema version is refused, read-only or not, with
    StoreConfigurationError (no retry reads it) that says to upgrade, and left as it was."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    with trio.fail_after(10):
        await store.create("s", b"snap", b"info")
        await store.aclose()
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA user_version = 99")
        conn.close()
        digest = _digest(path)
        for store in (SQLiteStore(path), SQLiteStore(path, readonly=True)):
            with pytest.raises(sa.StoreConfigurationError, match="schema version 99") as info:
                await store.load("s")
            assert "Upgrade sessionactors" in str(info.value)
            await store.aclose()
    assert _digest(path) == digest


class _Worker:
    """One claim worker process, spoken to line by line."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def send(self, command: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(command.encode() + b"\n")

    async def receive(self) -> str:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive_some()
            if not chunk:
                raise AssertionError(f"claim worker exited early ({self.process.returncode})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


async def test_claims_across_processes_have_one_winner(tmp_path: Path) -> None:
    """Eight processes claiming one session on one file: one winner a round, tokens increasing."""
    path = tmp_path / "shared.db"
    workers: list[_Worker] = []
    try:
        with trio.fail_after(60):
            for i in range(8):
                process = await trio.lowlevel.open_process(
                    [sys.executable, str(WORKER), str(path), f"worker-{i}"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                workers.append(_Worker(process))
            for worker in workers:
                assert await worker.receive() == "ready"
            fences: list[int] = []
            for _ in range(20):
                async with trio.open_nursery() as nursery:
                    for worker in workers:
                        nursery.start_soon(worker.send, "claim")
                answers = [await worker.receive() for worker in workers]
                winners = [(w, a) for w, a in zip(workers, answers, strict=True) if a != "lost"]
                assert len(winners) == 1, answers
                ((winner, answer),) = winners
                fences.append(int(answer.removeprefix("won ")))
                await winner.send("release")
                assert await winner.receive() == "released"
            assert fences == sorted(set(fences)), fences
            for worker in workers:
                await worker.send("exit")
            for worker in workers:
                assert await worker.process.wait() == 0
    finally:
        for worker in workers:
            if worker.process.returncode is None:
                worker.process.kill()
            with trio.CancelScope(shield=True):
                await worker.process.wait()
                for stream in (worker.process.stdin, worker.process.stdout):
                    if stream is not None:
                        await stream.aclose()


# -- rows written behind the store's back -----------------------------------------------


def _behind_the_back(path: Path, *statements: tuple[str, Sequence[object]]) -> None:
    """Change the file with plain sqlite3, as another program (or damage) would."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for sql, params in statements:
            conn.execute(sql, params)
    finally:
        conn.close()


async def _appends_in_one_transaction(
    store: SQLiteStore, path: Path, appends: dict[str, list[JournalEntry]]
) -> dict[str, BaseException | None]:
    """Run ``appends`` together, queued behind a first append (to the session "pilot")
    that waits for another connection's write lock, so that they share the next
    transaction; what each one raised (None: it returned)."""
    blocker = sqlite3.connect(path, isolation_level=None)
    results: dict[str, BaseException | None] = {}

    started: set[str] = set()

    async def append(name: str, entries: list[JournalEntry]) -> None:
        started.add(name)
        try:
            await store.append(name, entries, b"info-2")
        except Exception as exc:
            results[name] = exc
        else:
            results[name] = None

    try:
        blocker.execute("BEGIN IMMEDIATE")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(append, "pilot", _entries(1))
            await _wait_until(
                lambda: "pilot" in started and store.statistics().requests_queued == 0
            )
            assert "pilot" not in results  # it waits for the lock
            for name, entries in appends.items():
                nursery.start_soon(append, name, entries)
            await _wait_until(lambda: store.statistics().requests_queued == len(appends))
            blocker.execute("COMMIT")
    finally:
        blocker.close()
    assert results.pop("pilot") is None
    return results


async def test_a_stray_journal_row_fails_only_its_own_session(tmp_path: Path) -> None:
    """An append that collides with a journal row written behind the store's back fails
    alone, with StoreError naming its session; the appends committed with it succeed."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path, busy_timeout=30)
    names = [f"s{i}" for i in range(40)]
    try:
        with trio.fail_after(30):
            for name in [*names, "stray", "pilot"]:
                await store.create(name, b"snap", b"info")
            await store.append("stray", _entries(1), b"info")
            before = store.statistics()
            _behind_the_back(
                path, ("INSERT INTO journal VALUES (?, ?, ?)", ("stray", 3, b"behind the back"))
            )
            appends = {name: _entries(1) for name in names} | {"stray": _entries(2, 3)}
            results = await _appends_in_one_transaction(store, path, appends)
            assert store.statistics().largest_batch > before.largest_batch
            failed = {name: exc for name, exc in results.items() if exc is not None}
            assert list(failed) == ["stray"], failed
            assert isinstance(failed["stray"], StoreError)
            assert failed["stray"].session_id == "stray"
            assert "behind the store's back" in str(failed["stray"])
            for name in names:
                assert await store.read_journal(name, 0) == (0, _entries(1))
            # nothing of the failed append was written; the session goes on past the row
            assert await store.read_journal("stray", 0) == (
                0,
                [*_entries(1), JournalEntry(3, b"behind the back")],
            )
            await store.append("stray", _entries(4), b"info")
    finally:
        await store.aclose()


def test_a_stray_row_fails_a_grouped_insert(tmp_path: Path) -> None:
    """Negative control: the stray row makes the group's rows, inserted with one statement
    as grouped appends first are, fail as a whole."""
    path = tmp_path / "plain.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE journal (session_id, seq, data, PRIMARY KEY (session_id, seq))")
        conn.execute("INSERT INTO journal VALUES ('stray', 3, x'00')")
        conn.execute("BEGIN")
        rows = [(f"s{i}", 1, b"e") for i in range(40)] + [("stray", 2, b"e"), ("stray", 3, b"e")]
        with pytest.raises(sqlite3.IntegrityError):
            conn.executemany("INSERT INTO journal VALUES (?, ?, ?)", rows)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (("UPDATE sessions SET snapshot_seq = ?", (2**62,)), "the snapshot's seq"),
        (("UPDATE sessions SET snapshot_seq = ?", (-1,)), "the snapshot's seq"),
        (("UPDATE sessions SET snapshot_seq = ?", ("one",)), "the snapshot's seq"),
        (("UPDATE sessions SET trimmed_upto = ?", (MAX_SEQ + 1,)), "trimmed seq"),
        (("INSERT INTO journal VALUES ('s', ?, x'00')", (2**63 - 1,)), "journal seq"),
        (("INSERT INTO journal VALUES ('s', ?, x'00')", (2.5,)), "journal seq"),
        (("INSERT INTO journal VALUES ('s', ?, 'text')", (5,)), "not bytes"),
        (("UPDATE snapshots SET data = ?", ("text",)), "snapshot is not bytes"),
    ],
)
async def test_values_read_back_are_range_checked(
    tmp_path: Path, change: tuple[str, Sequence[object]], match: str
) -> None:
    """A seq out of range (or not an integer), or data that is not bytes, read back from
    the file is SnapshotCorruptError naming the session, from load or read_journal."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    try:
        with trio.fail_after(10):
            await store.create("s", b"snap", b"info")
            await store.append("s", _entries(1), b"info")
            await store.aclose()
            _behind_the_back(path, change)
            raised: list[SnapshotCorruptError] = []
            for read in (lambda: store.load("s"), lambda: store.read_journal("s", 0)):
                try:
                    await read()
                except SnapshotCorruptError as exc:
                    raised.append(exc)
            assert raised
            assert all(exc.session_id == "s" for exc in raised)
            assert all(match in str(exc) and "restore" in str(exc) for exc in raised)
    finally:
        await store.aclose()


async def test_a_seq_above_max_seq_is_refused_before_sqlite_sees_it(tmp_path: Path) -> None:
    """An append or snapshot at a seq beyond 2**63 (which SQLite cannot even hold) is a
    StoreError naming the session, not an OverflowError."""
    store = SQLiteStore(tmp_path / "s.db")
    try:
        with trio.fail_after(10):
            await store.create("s", b"snap", b"info")
            with pytest.raises(StoreError, match="MAX_SEQ") as info:
                await store.append("s", _entries(2**64), b"info")
            assert info.value.session_id == "s"
            with pytest.raises(StoreError, match="MAX_SEQ"):
                await store.write_snapshot("s", b"snap", 2**70, b"info", trim_upto=0)
            assert await store.read_journal("s", 2**70) == (0, [])
    finally:
        await store.aclose()


# -- files that are not a store ---------------------------------------------------------


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _another_programs_database(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('mine')")
    conn.commit()
    conn.close()


async def _truncated_store(path: Path) -> None:
    store = SQLiteStore(path)
    await store.create("s", b"snap", b"info")
    await store.aclose()
    path.write_bytes(b"")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        ("truncated", "the file is empty"),
        ("text", "not an SQLite database"),
        ("another program's", "does not hold the tables"),
    ],
)
async def test_a_file_that_is_not_a_store_is_refused_untouched(
    tmp_path: Path, make: str, match: str
) -> None:
    """A file that exists but is not a sessionactors store (truncated to 0 bytes, text,
    another program's SQLite database) fails the first call with StoreConfigurationError
    (no retry reads it), read-only or not, and is left as it was: it never reads as an
    empty store."""
    path = tmp_path / "s.db"
    if make == "truncated":
        await _truncated_store(path)
    elif make == "text":
        path.write_bytes(b"these are not the sessions you are looking for\n" * 100)
    else:
        _another_programs_database(path)
    digest = _digest(path)
    for store in (SQLiteStore(path), SQLiteStore(path, readonly=True)):
        try:
            with (
                trio.fail_after(10),
                pytest.raises(sa.StoreConfigurationError, match=match) as info,
            ):
                await store.list_sessions()
            assert "not a sessionactors store" in str(info.value)
        finally:
            await store.aclose()
    assert _digest(path) == digest


async def test_a_damaged_store_file_is_not_called_a_file_that_is_no_store(
    tmp_path: Path,
) -> None:
    """A store file that SQLite reads as damaged (SQLITE_CORRUPT) fails the first call
    with a message that says the file is damaged, to check it with PRAGMA
    integrity_check and to restore it from a backup, never that it is not a store, and
    is left as it was: a store that writes it raises StoreConfigurationError; a
    read-only store, whose reader may meet a file that another process writes so for a
    moment, a StoreError (a retry reads the file again)."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    await store.create("s", b"snap", b"info")
    await store.aclose()
    unusable_stores.damage_schema(path)
    digest = _digest(path)
    kinds = {False: sa.StoreConfigurationError, True: sa.StoreError}
    for readonly, kind in kinds.items():
        store = SQLiteStore(path, readonly=readonly)
        try:
            with trio.fail_after(10), pytest.raises(sa.StoreError) as info:
                await store.list_sessions()
            assert type(info.value) is kind, repr(info.value)
            message = str(info.value)
            assert "not a sessionactors store" not in message
            assert f"the sqlite store at {str(path)!r} is damaged" in message
            assert "PRAGMA integrity_check" in message
            assert "restore it from a backup" in message
        finally:
            await store.aclose()
    assert _digest(path) == digest


def test_sqlite_reads_an_empty_file_as_an_empty_database(tmp_path: Path) -> None:
    """Negative control: SQLite itself opens a truncated file as an empty database, which
    a store that only connected would list as holding no sessions."""
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
    finally:
        conn.close()


async def test_a_new_file_is_created_whole(tmp_path: Path) -> None:
    """A store on a path that does not exist creates the file with its tables, and
    leaves nothing beside it once closed (no temporary file, no lock file)."""
    path = tmp_path / "new.db"
    store = SQLiteStore(path)
    with trio.fail_after(10):
        assert await store.list_sessions() == []
        await store.aclose()
    conn = sqlite3.connect(path)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    finally:
        conn.close()
    assert {"sessions", "snapshots", "journal", "leases"} <= tables
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.db"]


# -- one file, several processes --------------------------------------------------------


class _Holder:
    """A process holding a store on a file (tests/stores/sqlite_holder.py)."""

    def __init__(self, process: trio.Process, first_line: str) -> None:
        self.process = process
        self.first_line = first_line

    @classmethod
    async def start(cls, path: Path, mode: str) -> _Holder:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(HOLDER), str(path), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        holder = cls(process, "")
        holder.first_line = await holder.receive()
        return holder

    @property
    def ready(self) -> bool:
        return self.first_line == "ready"

    async def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(command.encode() + b"\n")
        return await self.receive()

    async def receive(self) -> str:
        assert self.process.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            chunk = await self.process.stdout.receive_some(1)
            if not chunk:
                break
            line += chunk
        return line.decode().strip()

    async def stop(self) -> None:
        with trio.CancelScope(shield=True):
            if self.process.returncode is None and self.process.stdin is not None:
                with trio.move_on_after(10):
                    with contextlib.suppress(trio.BrokenResourceError):
                        await self.process.stdin.send_all(b"exit\n")
                    await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
            await self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    await stream.aclose()


async def test_a_second_process_is_refused_by_default(tmp_path: Path) -> None:
    """While one process has the file open, another process's store (and this one's) fails
    with StoreError naming the holder and saying how to share the file; once it closes,
    the file opens."""
    path = tmp_path / "s.db"
    holders: list[_Holder] = []
    try:
        with trio.fail_after(60):
            first = await _Holder.start(path, "exclusive")
            holders.append(first)
            assert first.ready, first.first_line
            assert await first.ask("create a") == "created"
            second = await _Holder.start(path, "exclusive")
            holders.append(second)
            assert second.first_line.startswith("refused ")
            assert f"process {first.process.pid} (exclusive)" in second.first_line
            here = SQLiteStore(path)
            with pytest.raises(
                StoreError,
                match=r"in use by .*--workers.*RedisStore.*shared=True.*LeaseHeldError.*readonly=True",
            ):
                await here.list_sessions()
            await here.aclose()
            await first.stop()
            assert await here.list_sessions() == [("a", b"info")]
            await here.aclose()
    finally:
        for holder in holders:
            await holder.stop()


async def test_processes_that_share_the_file_all_open_it(tmp_path: Path) -> None:
    """Stores opened with shared=True in several processes all work, and see each other's
    sessions; a store that is not shared is refused meanwhile, and the other way round."""
    path = tmp_path / "s.db"
    holders: list[_Holder] = []
    try:
        with trio.fail_after(60):
            for _ in range(3):
                holders.append(await _Holder.start(path, "shared"))
            assert all(holder.ready for holder in holders), [h.first_line for h in holders]
            assert await holders[0].ask("create a") == "created"
            assert await holders[1].ask("create b") == "created"
            assert await holders[2].ask("list") == "a,b"
            shared = SQLiteStore(path, shared=True)
            assert shared.shared_by_workers
            assert [name for name, _ in await shared.list_sessions()] == ["a", "b"]
            await shared.aclose()
            unshared = await _Holder.start(path, "exclusive")
            holders.append(unshared)
            assert unshared.first_line.startswith("refused ")
            assert "shared=True" in unshared.first_line
            for holder in holders:
                await holder.stop()
            holders = [await _Holder.start(path, "exclusive")]
            assert holders[0].ready
            late = await _Holder.start(path, "shared")
            holders.append(late)
            assert late.first_line.startswith("refused ")
            assert "opened it unshared" in late.first_line
    finally:
        for holder in holders:
            await holder.stop()


async def test_a_read_only_store_reads_a_file_in_use_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """readonly=True opens a file another process writes, reads its sessions, refuses
    every write with StoreError, and leaves the file's bytes as they were."""
    path = tmp_path / "s.db"
    holder = await _Holder.start(path, "exclusive")
    try:
        with trio.fail_after(60):
            assert holder.ready, holder.first_line
            assert await holder.ask("create a") == "created"
            digest = _digest(path)
            reader = SQLiteStore(path, readonly=True)
            assert not reader.shared_by_workers
            assert await reader.list_sessions() == [("a", b"info")]
            assert await reader.load("a") == StoredSession(
                snapshot=b"snapshot",
                snapshot_seq=0,
                entries=(JournalEntry(1, b"entry"),),
                info=b"info",
            )
            writes = [
                reader.create("b", b"snap", b"info"),
                reader.append("a", _entries(2), b"info"),
                reader.write_snapshot("a", b"snap", 1, b"info", trim_upto=0),
                reader.delete("a"),
                reader.claim("a", "me", 30),
            ]
            for write in writes:
                with pytest.raises(StoreError, match="read-only"):
                    await write
            await reader.aclose()
            assert await holder.ask("create c") == "created"  # the holder still writes
            assert await holder.ask("list") == "a,c"
            assert _digest(path) == digest  # the new session went to the WAL, not the file
    finally:
        await holder.stop()


def _files(path: Path) -> dict[str, str | None]:
    """The digest of the database and of its -wal and -shm files (None: absent)."""
    out: dict[str, str | None] = {}
    for suffix in ("", "-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        out[suffix] = _digest(side) if side.exists() else None
    return out


async def test_a_read_only_store_changes_no_byte_of_the_wal_or_shm(tmp_path: Path) -> None:
    """readonly=True leaves the database, its WAL and its shared-memory file byte for
    byte as they were, while another process writes the file (a plain read-only SQLite
    connection records its read position in the -shm file)."""
    path = tmp_path / "s.db"
    holder = await _Holder.start(path, "exclusive")
    try:
        with trio.fail_after(60):
            assert holder.ready, holder.first_line
            for name in ("a", "b"):
                assert await holder.ask(f"create {name}") == "created"  # written after any read
                before = _files(path)
                assert before["-shm"] is not None
                reader = SQLiteStore(path, readonly=True)
                assert [n for n, _ in await reader.list_sessions()][-1] == name
                assert await reader.load(name) is not None
                await reader.aclose()
                assert _files(path) == before
    finally:
        await holder.stop()


def test_a_plain_read_only_connection_changes_the_shm(tmp_path: Path) -> None:
    """Negative control: SQLite's mode=ro alone writes the -shm file of a database that
    another process has open (what the test above would catch)."""
    path = tmp_path / "raw.db"
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("PRAGMA journal_mode = WAL")
        writer.execute("CREATE TABLE t (x)")
        writer.execute("INSERT INTO t VALUES (1)")
        before = _files(path)
        code = (
            "import sqlite3, sys; "
            "c = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True); "
            "c.execute('SELECT count(*) FROM t').fetchone(); c.close()"
        )
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
        assert _files(path)["-shm"] != before["-shm"]
    finally:
        writer.close()


async def test_a_read_only_store_of_a_closed_file_creates_nothing_and_sees_a_writer_start(
    tmp_path: Path,
) -> None:
    """readonly=True on a file no process has open creates no -wal or -shm file beside
    it; once a writer opens the file, the same reader sees what it writes."""
    path = tmp_path / "s.db"
    writer = SQLiteStore(path)
    await writer.create("a", b"snapshot", b"info")
    await writer.aclose()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["s.db"]
    reader = SQLiteStore(path, readonly=True)
    try:
        with trio.fail_after(60):
            assert await reader.list_sessions() == [("a", b"info")]
            assert sorted(p.name for p in tmp_path.iterdir()) == files
            holder = await _Holder.start(path, "exclusive")
            try:
                assert holder.ready, holder.first_line
                assert await holder.ask("create b") == "created"
                assert [n for n, _ in await reader.list_sessions()] == ["a", "b"]
            finally:
                await holder.stop()
    finally:
        await reader.aclose()


async def test_a_read_only_store_needs_an_existing_file(tmp_path: Path) -> None:
    """readonly=True on a path where there is no file raises StoreError and creates none."""
    reader = SQLiteStore(tmp_path / "none.db", readonly=True)
    with trio.fail_after(10), pytest.raises(StoreError, match="does not exist"):
        await reader.list_sessions()
    await reader.aclose()
    assert list(tmp_path.iterdir()) == []


async def test_stores_of_one_process_share_its_lock(tmp_path: Path) -> None:
    """Two stores of one process on one file both work; the process keeps the file
    locked until the last of them closes."""
    path = tmp_path / "s.db"
    first, second = SQLiteStore(path), SQLiteStore(str(path))
    holders: list[_Holder] = []
    try:
        with trio.fail_after(60):
            await first.create("a", b"snap", b"info")
            assert await second.list_sessions() == [("a", b"info")]
            await first.aclose()
            holders.append(await _Holder.start(path, "exclusive"))
            assert holders[-1].first_line.startswith("refused ")
            await second.aclose()
            holders.append(await _Holder.start(path, "exclusive"))
            assert holders[-1].ready
    finally:
        await first.aclose()
        await second.aclose()
        for holder in holders:
            await holder.stop()


def test_sharing_flags_must_be_booleans() -> None:
    """shared and readonly take True or False only."""
    with pytest.raises(TypeError, match="shared"):
        SQLiteStore("x.db", shared="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="readonly"):
        SQLiteStore("x.db", readonly=1)  # type: ignore[arg-type]
    assert not SQLiteStore("x.db").shared_by_workers
    assert "shared" in repr(SQLiteStore("x.db", shared=True))


async def test_a_read_only_store_of_a_closed_file_sees_a_writer_that_came_and_went(
    tmp_path: Path,
) -> None:
    """A reader that opened a file no process had open sees what a writer stored
    while it had the file open, also when that writer has closed the file again
    (its -wal and -shm gone) before the reader's next read."""
    path = tmp_path / "s.db"
    writer = SQLiteStore(path)
    await writer.create("a", b"snapshot", b"info")
    await writer.aclose()
    reader = SQLiteStore(path, readonly=True)
    try:
        with trio.fail_after(60):
            assert [n for n, _ in await reader.list_sessions()] == ["a"]
            writer = SQLiteStore(path)
            await writer.create("b", b"snapshot", b"info")
            assert await writer.delete("a")
            await writer.aclose()
            assert sorted(p.name for p in tmp_path.iterdir()) == ["s.db"]
            assert [n for n, _ in await reader.list_sessions()] == ["b"]
            assert await reader.load("a") is None
    finally:
        await reader.aclose()


async def test_the_write_ahead_log_shrinks_back_after_a_burst(tmp_path: Path) -> None:
    """A burst of large writes (an import, a pasted document) grows the -wal file; once
    checkpointed, the next write truncates it back to at most 4 MiB (SQLite keeps a
    write-ahead log at its largest size unless told to shrink it)."""
    path = tmp_path / "sessions.db"
    big = "x" * 1_000_000
    async with sa.open_registry(store=SQLiteStore(path)) as registry:
        ref = await registry.spawn("s", agent="support")
        for _ in range(3):  # each a commit of about 8 MB
            await ref.add_messages([sa.Message.create(sa.Role.USER, big) for _ in range(8)])
        wal = Path(f"{path}-wal")
        assert wal.stat().st_size > 8_000_000
        await ref.truncate(0)
        for i in range(5):
            await ref.set_metadata({"n": i})
        assert wal.stat().st_size <= 4 * 1024 * 1024, wal.stat().st_size


async def test_a_close_cut_short_while_the_file_stalls_loses_nothing(tmp_path: Path) -> None:
    """aclose ends with the caller's bound while the store's thread is stalled on the file
    (its write waits for another connection's write lock, as on a stalled disk); the write
    lands once the file answers, its caller gets its answer, and the thread then stops."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path, busy_timeout=3.0)
    answered: list[str] = []

    async def append() -> None:
        await store.append("s", _entries(1), b"info")
        answered.append("appended")

    with trio.fail_after(10):
        await store.create("s", b"snap", b"info")
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")  # the store's next write waits
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append)
                await trio.testing.wait_all_tasks_blocked()  # (its request is queued)
                await _wait_until(lambda: store.statistics().requests_queued == 0)
                began = trio.current_time()
                with trio.move_on_after(0.2):
                    await store.aclose()
                assert trio.current_time() - began < 1.0, "the close waited for the stall"
                blocker.execute("ROLLBACK")  # the file answers again
        finally:
            blocker.close()
        assert answered == ["appended"]
        await _wait_until(lambda: not _worker_threads())
        other = SQLiteStore(path)
        assert (await other.load("s")) == StoredSession(
            snapshot=b"snap", snapshot_seq=0, entries=tuple(_entries(1)), info=b"info"
        )
        await other.aclose()


def _rot_name(path: Path, name: str, raw: bytes) -> None:
    """Rename session ``name`` to the bytes ``raw`` (not UTF-8) in every table, as bit
    rot in the file would, behind the store's back; the file stays well-formed."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for table in ("sessions", "snapshots", "journal", "leases"):
            conn.execute(
                f"UPDATE {table} SET session_id = CAST(? AS TEXT) WHERE session_id = ?",
                (raw, name),
            )
        conn.commit()
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


async def test_a_session_name_that_is_not_utf8_is_left_out_of_listings_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stored session whose name is not valid UTF-8 (damage in the file) is left out of
    the registry's listings with a WARNING that names its bytes and how to delete it;
    the other sessions list and wake as before."""
    path = tmp_path / "rot.db"
    agent = sa.Agent(model=sa.testing.EchoModel())
    async with sa.open_registry(store=SQLiteStore(path), agents={"echo": agent}) as registry:
        for name in ("alpha", "beta", "x19"):  # x19 last: the newest, listed first
            await (await registry.spawn(name)).send("hello")
    _rot_name(path, "x19", b"\xff19")
    caplog.set_level("WARNING", logger="sessionactors")
    async with sa.open_registry(store=SQLiteStore(path), agents={"echo": agent}) as registry:
        with trio.fail_after(30):
            assert [i.session_id for i in await registry.sessions()] == ["beta", "alpha"]
            assert [i.session_id for i in await registry.sessions(limit=1)] == ["beta"]
            assert await registry.pending_reviews() == []
            assert (await registry.ref("alpha").send("again")).text == "again"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned
    assert all("$'\\xff19'" in text and "sessions delete" in text for text in warned), warned


async def test_a_live_session_whose_rows_are_gone_says_its_data_may_be_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A live session whose rows are gone from the file when it writes (deleted behind the
    store's back, a restore from an older copy) fails its turn with a
    SessionNotFoundError that says the store no longer holds a session this process had
    loaded, not that it was never created; the registry logs that at ERROR."""
    path = tmp_path / "lost.db"
    agent = sa.Agent(model=sa.testing.EchoModel())
    async with sa.open_registry(store=SQLiteStore(path), agents={"echo": agent}) as registry:
        with trio.fail_after(30):
            ref = await registry.spawn("s")
            assert (await ref.send("one")).text == "one"
            ended: list[BaseException] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_until_it_ends, ref, ended)
                await trio.testing.wait_all_tasks_blocked()
                with contextlib.closing(sqlite3.connect(path)) as conn:
                    for table in ("journal", "snapshots", "leases", "sessions"):
                        conn.execute(f"DELETE FROM {table}")
                    conn.commit()
                with pytest.raises(SessionNotFoundError) as caught:
                    await ref.send("two")
    said = str(caught.value)
    assert [str(e) for e in ended] == [said]  # a subscriber is told, not left waiting
    assert "no longer holds session 's', which this process had loaded" in said, said
    assert "create it first" not in said, said
    errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "sessionactors"]
    assert any("which this process had loaded" in r.getMessage() for r in errors), caplog.text


async def test_a_snapshot_seq_set_back_behind_its_snapshot_folds_no_entry_twice(
    tmp_path: Path, echo_agents: dict[str, sa.Agent]
) -> None:
    """A session's row whose snapshot seq was set back (damage to the store's record,
    behind its back) reads the journal entries its snapshot already holds: they are not
    folded in a second time (every message once), for a read and for a wake, and the
    session goes on from there."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        ref = await registry.spawn("s")
        for text in ("one", "two"):
            await ref.send(text)
        await ref.hibernate()  # the snapshot holds both turns; the journal still has them
        expected = [m.id for m in await ref.history()]
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("UPDATE sessions SET snapshot_seq = 0 WHERE session_id = 's'")
        db.commit()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            assert [m.id for m in (await sa.read_session(registry.store, "s")).messages] == expected
            ref = registry.ref("s")
            assert [m.id for m in await ref.history()] == expected
            await ref.send("three")
            assert len(await ref.history()) == len(expected) + 2
