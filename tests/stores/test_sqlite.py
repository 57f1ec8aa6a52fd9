"""SQLiteStore keeps the store contract, durably, across runs and processes."""

from __future__ import annotations

import gc
import itertools
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from sessionactors import SessionNotFoundError, StoreError
from sessionactors.stores import JournalEntry, SQLiteStore, StoredSession, _sqlite
from sessionactors.testing import check_store

WORKER = Path(__file__).with_name("sqlite_claim_worker.py")


def _entries(*seqs: int) -> list[JournalEntry]:
    return [JournalEntry(seq, b"e-%d" % seq) for seq in seqs]


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sessionactors-sqlite")]


async def _wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.002)


async def test_sqlite_store_passes_check_store(tmp_path: Path) -> None:
    """SQLiteStore, on a fresh file for each store, passes the store conformance suite."""
    counter = itertools.count()
    with trio.fail_after(30):
        await check_store(lambda: SQLiteStore(tmp_path / f"store-{next(counter)}.db"))
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
            snapshot=b"snap", snapshot_seq=0, entries=tuple(_entries(1, 2, 3))
        )
        await other.aclose()


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


async def test_wal_and_full_synchronous_are_in_effect(tmp_path: Path) -> None:
    """The file is in WAL mode and the store's connection commits with synchronous=FULL."""
    path = tmp_path / "s.db"

    def synchronous(conn: sqlite3.Connection, now: float) -> int:
        return int(conn.execute("PRAGMA synchronous").fetchone()[0])

    with trio.fail_after(10):
        store = SQLiteStore(path)
        assert await store._call(None, synchronous, writes=False) == 2  # FULL
        await store.aclose()
        relaxed = SQLiteStore(path, synchronous="normal")
        assert await relaxed._call(None, synchronous, writes=False) == 1  # NORMAL
        await relaxed.aclose()
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


async def test_grouped_appends_that_skip_the_refusal_check_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: appends grouped without checking that every one was accepted
    fail the same checks (the stale append's rows collide, and the batch is lost)."""

    def unchecked(conn: sqlite3.Connection, appends: list[tuple[object, ...]]) -> bool:
        conn.executemany(
            "UPDATE sessions SET last_seq = ?, info = ? WHERE session_id = ?",
            [(last, info, sid) for sid, _, info, _, last in appends],
        )
        conn.executemany(
            "INSERT INTO journal (session_id, seq, data) VALUES (?, ?, ?)",
            [row for _, rows, _, _, _ in appends for row in rows],  # type: ignore[attr-defined]
        )
        return True

    monkeypatch.setattr(_sqlite, "_append_all", unchecked)
    results, store = await _mixed_batch(tmp_path / "s.db")
    try:
        assert _batch_problems(results) != []
    finally:
        await store.aclose()


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


async def test_unopenable_file_raises_store_error(tmp_path: Path) -> None:
    """A file that cannot be opened fails the call with StoreError naming the path."""
    store = SQLiteStore(tmp_path / "no-such-dir" / "s.db")
    with trio.fail_after(10), pytest.raises(StoreError, match="no-such-dir") as info:
        await store.create("s", b"snap", b"info")
    assert info.value.session_id == "s"
    assert isinstance(info.value.__cause__, sqlite3.Error)
    await store.aclose()


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    """A file written by a newer schema version is refused with StoreError."""
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    with trio.fail_after(10):
        await store.create("s", b"snap", b"info")
        await store.aclose()
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA user_version = 99")
        conn.close()
        with pytest.raises(StoreError, match="schema version 99"):
            await store.load("s")
        await store.aclose()


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
