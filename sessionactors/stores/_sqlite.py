"""``SQLiteStore``: the embedded default store, one SQLite file in WAL mode.

One OS thread owns the connection and serves requests from a queue, so the
trio thread never blocks on the disk. Each time it wakes it takes everything
queued and runs it in one transaction (``BEGIN IMMEDIATE ... COMMIT``): the
appends of many sessions share one fsync'd commit, and one failing request does
not fail the others. Appends check everything before they write, and a batch's
appends go in with one statement per table (one by one if any is refused);
every other request runs in its own savepoint. The callers are answered after
the commit, with one wakeup per trio run.

Leases live in the same file, so they work across processes: a claim is a
single upsert, and a fenced write checks the token inside the transaction
that writes, while holding the database's write lock.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple, cast

import attrs
import outcome
import trio

from .._errors import StoreError
from ._base import JournalEntry, Lease, StoredSession
from ._memory import (
    _check_entries,
    _check_snapshot_seqs,
    _check_ttl,
    _exists_error,
    _fence_problem,
    _fenced_out_error,
    _not_found_error,
)

__all__ = ["SQLiteStore", "SQLiteStoreStatistics"]

_SCHEMA_VERSION: Final = 1
_SCHEMA: Final = (
    # The snapshot lives in a table of its own: appends update a session's row
    # (last_seq, info), and that must not rewrite a large snapshot each time.
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id TEXT PRIMARY KEY NOT NULL,
        snapshot_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        trimmed_upto INTEGER NOT NULL,
        info BLOB NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS snapshots (
        session_id TEXT PRIMARY KEY NOT NULL,
        data BLOB NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS journal (
        session_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (session_id, seq)
    )""",
    # A lease row outlives its session (owner set to NULL on delete), so a
    # name deleted and created again keeps getting larger fencing tokens.
    """CREATE TABLE IF NOT EXISTS leases (
        session_id TEXT PRIMARY KEY NOT NULL,
        owner TEXT,
        fence INTEGER NOT NULL,
        lease_until REAL NOT NULL
    )""",
    "PRAGMA user_version = 1",  # _SCHEMA_VERSION
)
# PRAGMA values cannot be bound parameters: only these fixed statements are run.
_SYNCHRONOUS: Final = {
    "OFF": "PRAGMA synchronous = OFF",
    "NORMAL": "PRAGMA synchronous = NORMAL",
    "FULL": "PRAGMA synchronous = FULL",
    "EXTRA": "PRAGMA synchronous = EXTRA",
}
_MAX_BATCH: Final = 1024

_CLAIM: Final = """
    INSERT INTO leases (session_id, owner, fence, lease_until)
    VALUES (:session_id, :owner, 1, :until)
    ON CONFLICT (session_id) DO UPDATE
        SET owner = excluded.owner, fence = fence + 1, lease_until = excluded.lease_until
        WHERE owner IS NULL OR owner = excluded.owner OR lease_until < :now
    RETURNING fence
"""

_Op = Callable[..., Any]  # (connection, now, *args)


@attrs.frozen(kw_only=True)
class SQLiteStoreStatistics:
    """A snapshot of an :class:`SQLiteStore`'s counters.

    ``commits``: write transactions committed. ``appends``: ``append`` calls
    committed. ``largest_batch``: the most requests served by one transaction.
    ``requests_queued``: requests now waiting for the connection's thread.
    """

    commits: int
    appends: int
    largest_batch: int
    requests_queued: int


@attrs.define(eq=False)
class _Counters:
    lock: threading.Lock = attrs.Factory(threading.Lock)
    commits: int = 0
    appends: int = 0
    largest_batch: int = 0


_QUEUED: Final = 0
_RUNNING: Final = 1
_WITHDRAWN: Final = 2


class _Request:
    """One call waiting for the connection's thread; ``op is None`` means: stop."""

    __slots__ = (
        "args",
        "op",
        "raise_cancel",
        "session_id",
        "state",
        "task",
        "token",
        "worker",
        "writes",
    )

    def __init__(
        self,
        op: _Op | None,
        *,
        session_id: str | None,
        writes: bool,
        waiter: bool = True,
        args: tuple[Any, ...] = (),
    ) -> None:
        self.op = op
        self.args = args
        self.worker: _Worker | None = None
        self.session_id = session_id
        self.writes = writes
        self.state = _QUEUED
        self.raise_cancel: Any = None
        if waiter:
            self.token: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
            self.task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        else:
            self.token = self.task = None

    def abort(self, raise_cancel: Any) -> trio.lowlevel.Abort:
        """The abort function of the waiting caller (runs on its trio thread)."""
        assert self.worker is not None
        if self.worker.withdraw(self):
            return trio.lowlevel.Abort.SUCCEEDED
        self.raise_cancel = raise_cancel
        return trio.lowlevel.Abort.FAILED


def _deliver(answers: list[tuple[_Request, outcome.Outcome[Any]]]) -> None:
    # Runs on the callers' trio thread, so it never races the abort function.
    for request, result in answers:
        if request.raise_cancel is not None:
            result = outcome.capture(request.raise_cancel)
        assert request.task is not None
        trio.lowlevel.reschedule(request.task, result)


def _answer(answers: Sequence[tuple[_Request, outcome.Outcome[Any]]]) -> None:
    """Wake every caller: one hop per trio run, not one per request."""
    by_token: dict[trio.lowlevel.TrioToken, list[tuple[_Request, outcome.Outcome[Any]]]] = {}
    for request, result in answers:
        if request.token is not None:
            by_token.setdefault(request.token, []).append((request, result))
    for token, group in by_token.items():
        # The caller's run is over (it was interrupted): nobody is left to answer.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(_deliver, group)


def _store_error(path: str, request: _Request, exc: BaseException) -> StoreError:
    about = f"session {request.session_id!r}: " if request.session_id is not None else ""
    error = StoreError(
        f"{about}the sqlite store at {path!r} failed ({exc}); "
        "check the file, its directory and the disk, then retry",
        session_id=request.session_id,
    )
    error.__cause__ = exc
    return error


class _Worker:
    """The OS thread that owns one connection, and its queue of requests."""

    def __init__(self, store: SQLiteStore) -> None:
        self._path = store.path
        self._synchronous = _SYNCHRONOUS[store.synchronous]
        self._busy_timeout = store.busy_timeout
        self._counters = store._counters
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[_Request] = deque()
        self.queued = 0
        self._stopping = False
        self._waiting = False  # the thread waits for requests (under _lock)
        self._thread = threading.Thread(
            target=self._run, name=f"sessionactors-sqlite {self._path}", daemon=True
        )
        self._thread.start()

    # Called from trio threads -------------------------------------------------

    def submit(self, request: _Request) -> bool:
        """Queue ``request``; ``False`` if this worker is stopping and takes no more."""
        with self._lock:
            if self._stopping:
                return False
            if request.op is None:
                self._stopping = True
            self._queue.append(request)
            self.queued += 1
            if self._waiting:  # a busy thread takes the queue when it is done
                self._wakeup.notify()
        return True

    def withdraw(self, request: _Request) -> bool:
        """Take back a request the thread has not started; whether that worked."""
        with self._lock:
            if request.state != _QUEUED:
                return False
            request.state = _WITHDRAWN
            self.queued -= 1
            return True

    def stop_nowait(self) -> None:
        self.submit(_Request(None, session_id=None, writes=False, waiter=False))

    def join(self) -> None:
        self._thread.join()

    # The thread ---------------------------------------------------------------

    def _take_batch(self) -> list[_Request]:
        with self._lock:
            while not self._queue:
                self._waiting = True
                self._wakeup.wait()
                self._waiting = False
            batch: list[_Request] = []
            while self._queue and len(batch) < _MAX_BATCH:
                request = self._queue.popleft()
                if request.state == _WITHDRAWN:
                    continue
                request.state = _RUNNING
                self.queued -= 1
                batch.append(request)
            return batch

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                batch = self._take_batch()
                stop = [r for r in batch if r.op is None]
                work = [r for r in batch if r.op is not None]
                if work:
                    conn = self._serve(conn, work)
                if stop:
                    # Nothing can be queued after a stop request.
                    if conn is not None:
                        conn.close()
                        conn = None
                    _answer([(stop[0], outcome.Value(None))])
                    return
        finally:
            if conn is not None:
                conn.close()

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=True
        )
        try:
            (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot use WAL mode (journal mode is {mode!r})")
            conn.execute(self._synchronous)
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version < _SCHEMA_VERSION:
                conn.execute("BEGIN IMMEDIATE")
                (version,) = conn.execute("PRAGMA user_version").fetchone()
                if version < _SCHEMA_VERSION:
                    for statement in _SCHEMA:
                        conn.execute(statement)
                conn.execute("COMMIT")
            if version > _SCHEMA_VERSION:
                raise sqlite3.DatabaseError(
                    f"the file has schema version {version}, newer than this version of "
                    f"sessionactors reads ({_SCHEMA_VERSION}); upgrade sessionactors"
                )
        except BaseException:
            conn.close()
            raise
        return conn

    def _serve(
        self, conn: sqlite3.Connection | None, batch: list[_Request]
    ) -> sqlite3.Connection | None:
        """Run ``batch`` in one transaction and answer every request; return the connection."""
        results: list[outcome.Outcome[Any]] = []
        writes = any(r.writes for r in batch)
        try:
            if conn is None:
                conn = self._open()
            conn.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
            results = self._run_all(conn, batch)
            conn.execute("COMMIT")
        except Exception as exc:
            # The whole transaction is lost (or the file could not be opened): fail
            # every request, and start afresh with a new connection next time.
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                conn.close()
            _answer([(r, outcome.Error(_store_error(self._path, r, exc))) for r in batch])
            return None
        with self._counters.lock:
            if writes:
                self._counters.commits += 1
            self._counters.appends += sum(
                1
                for request, result in zip(batch, results, strict=True)
                if request.op is _append and isinstance(result, outcome.Value)
            )
            self._counters.largest_batch = max(self._counters.largest_batch, len(batch))
        _answer(list(zip(batch, results, strict=True)))
        return conn

    def _run_all(
        self, conn: sqlite3.Connection, batch: list[_Request]
    ) -> list[outcome.Outcome[Any]]:
        """Every request's outcome, run in order; consecutive plain appends run in bulk."""
        results: list[outcome.Outcome[Any]] = []
        run: list[_Request] = []
        for request in batch:
            if _bulk_append(request):
                run.append(request)
                continue
            if run:
                results += self._run_appends(conn, run)
                run = []
            results.append(self._run_one(conn, request))
        if run:
            results += self._run_appends(conn, run)
        return results

    def _run_appends(
        self, conn: sqlite3.Connection, run: list[_Request]
    ) -> list[outcome.Outcome[Any]]:
        if len(run) > 1 and _append_all(conn, [cast(_AppendArgs, r.args) for r in run]):
            return [outcome.Value(None) for _ in run]
        return [self._run_one(conn, r) for r in run]

    def _run_one(self, conn: sqlite3.Connection, request: _Request) -> outcome.Outcome[Any]:
        assert request.op is not None
        if request.op is _append:
            # An append checks everything before it writes, so a refusal leaves nothing
            # to undo; an SQLite error in it fails the whole batch (no savepoint needed).
            try:
                return outcome.Value(request.op(conn, time.time(), *request.args))
            except sqlite3.Error:
                raise
            except Exception as exc:
                return outcome.Error(exc)
        conn.execute("SAVEPOINT request")
        try:
            value = request.op(conn, time.time(), *request.args)
        except sqlite3.Error as exc:
            # Undo just this request; if that is impossible, the error aborts the batch.
            conn.execute("ROLLBACK TO request")
            conn.execute("RELEASE request")
            return outcome.Error(_store_error(self._path, request, exc))
        except Exception as exc:
            conn.execute("ROLLBACK TO request")
            conn.execute("RELEASE request")
            return outcome.Error(exc)
        conn.execute("RELEASE request")
        return outcome.Value(value)


def _fspath(path: str | os.PathLike[str]) -> str:
    return os.fspath(path)


def _upper(value: str) -> str:
    return value.upper()


def _check_synchronous(_: object, __: object, value: str) -> None:
    if value not in _SYNCHRONOUS:
        raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS)}, not {value!r}")


def _check_busy_timeout(_: object, __: object, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"busy_timeout must be a number of seconds >= 0, not {value!r}")


def _check_fence(conn: sqlite3.Connection, session_id: str, fence: int | None, now: float) -> None:
    if fence is None:
        return
    row = conn.execute(
        "SELECT owner, fence, lease_until FROM leases WHERE session_id = ?", (session_id,)
    ).fetchone()
    problem = _fence_problem(
        fence=fence,
        owner=row[0] if row else None,
        current=row[1] if row else None,
        lease_until=row[2] if row else 0.0,
        now=now,
    )
    if problem is not None:
        raise _fenced_out_error(session_id, fence, problem)


class _AppendArgs(NamedTuple):
    """What ``_append`` is called with, after the connection and the time."""

    session_id: str
    rows: list[tuple[str, int, bytes]]
    info: bytes
    fence: int | None
    last_seq: int | None  # None: no entries, only the info changes


def _append(
    conn: sqlite3.Connection,
    now: float,
    session_id: str,
    rows: list[tuple[str, int, bytes]],
    info: bytes,
    fence: int | None,
    last_seq: int | None,
) -> None:
    """``SQLiteStore.append`` in the transaction: it checks everything before it writes
    (see ``_Worker._run_one``)."""
    if fence is not None:
        if not conn.execute(
            "SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)
        ).fetchone():
            raise _not_found_error(session_id)
        _check_fence(conn, session_id, fence, now)
    if last_seq is None:
        updated = conn.execute(
            "UPDATE sessions SET info = ? WHERE session_id = ? RETURNING 1", (info, session_id)
        ).fetchone()
    else:
        updated = conn.execute(
            "UPDATE sessions SET last_seq = ?, info = ? "
            "WHERE session_id = ? AND last_seq < ? RETURNING 1",
            (last_seq, info, session_id, rows[0][1]),
        ).fetchone()
    if updated is None:  # nothing was written: say why
        row = conn.execute(
            "SELECT last_seq FROM sessions WHERE session_id = ?", (session_id,)
        ).fetchone()
        if row is None:
            raise _not_found_error(session_id)
        _check_entries(session_id, [JournalEntry(seq, data) for _, seq, data in rows], row[0])
        raise AssertionError("unreachable: the seqs were checked")  # pragma: no cover
    conn.executemany("INSERT INTO journal (session_id, seq, data) VALUES (?, ?, ?)", rows)


def _bulk_append(request: _Request) -> bool:
    """An append that can join others in one statement: entries, and no fence to check."""
    if request.op is not _append:
        return False
    args = cast(_AppendArgs, request.args)
    return args.fence is None and args.last_seq is not None


def _append_all(conn: sqlite3.Connection, appends: list[_AppendArgs]) -> bool:
    """Run many fence-free appends with one statement per table; False (and nothing
    written) if any of them is refused, for the caller to run them one by one."""
    conn.execute("SAVEPOINT appends")
    updated = conn.executemany(
        "UPDATE sessions SET last_seq = ?, info = ? WHERE session_id = ? AND last_seq < ?",
        [(a.last_seq, a.info, a.session_id, a.rows[0][1]) for a in appends],
    ).rowcount
    if updated != len(appends):
        conn.execute("ROLLBACK TO appends")
        conn.execute("RELEASE appends")
        return False
    conn.executemany(
        "INSERT INTO journal (session_id, seq, data) VALUES (?, ?, ?)",
        [row for a in appends for row in a.rows],
    )
    conn.execute("RELEASE appends")
    return True


@attrs.define(eq=False, repr=False)
class SQLiteStore:
    """A :class:`~sessionactors.stores.Store` in one SQLite file (WAL mode).

    ``SQLiteStore("sessions.db")`` does no I/O: the file is opened (and created,
    with its tables) on first use, and opened again on use after :meth:`aclose`,
    so one store object can be made before ``trio.run`` and serve successive
    runs. ``synchronous`` is SQLite's setting (``"FULL"``: every commit is
    fsync'd; ``"NORMAL"`` trades the durability of the last commits on power
    loss for speed). ``busy_timeout`` is how long, in seconds, to wait for
    another process's write lock before failing with ``StoreError``.

    Several processes may share the file: leases and fencing make a session
    live in one of them at a time.

    A call cancelled while queued is withdrawn and never runs. A call already
    being written waits for its transaction to finish (milliseconds; at most
    ``busy_timeout`` more while another process holds the write lock) and then
    raises ``Cancelled``: its write happened completely or not at all, and
    nothing of it is left running. :meth:`statistics` shows how well appends
    are grouped.
    """

    path: str = attrs.field(converter=_fspath)
    synchronous: str = attrs.field(
        default="FULL", kw_only=True, converter=_upper, validator=_check_synchronous
    )
    busy_timeout: float = attrs.field(
        default=5.0, kw_only=True, converter=float, validator=_check_busy_timeout
    )
    _counters: _Counters = attrs.field(init=False, factory=_Counters, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    _worker: _Worker | None = attrs.field(init=False, default=None, repr=False)
    _finalizer: weakref.finalize[Any, Any] | None = attrs.field(
        init=False, default=None, repr=False
    )

    def __repr__(self) -> str:
        state = "open" if self._worker is not None else "closed"
        return f"<SQLiteStore {self.path!r} ({state})>"

    def statistics(self) -> SQLiteStoreStatistics:
        """The store's counters (they survive ``aclose``)."""
        worker = self._worker
        counters = self._counters
        with counters.lock:
            return SQLiteStoreStatistics(
                commits=counters.commits,
                appends=counters.appends,
                largest_batch=counters.largest_batch,
                requests_queued=worker.queued if worker is not None else 0,
            )

    # Plumbing -------------------------------------------------------------------

    def _submit(self, request: _Request) -> _Worker:
        while True:
            with self._lock:
                if self._worker is None:
                    self._worker = _Worker(self)
                    # A store dropped without aclose() still stops its thread.
                    self._finalizer = weakref.finalize(self, self._worker.stop_nowait)
                worker = self._worker
            if worker.submit(request):
                return worker
            with self._lock:
                if self._worker is worker:
                    self._worker = None

    async def _call(
        self,
        session_id: str | None,
        op: _Op,
        *,
        writes: bool,
        args: tuple[Any, ...] = (),
    ) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        request = _Request(op, session_id=session_id, writes=writes, args=args)
        request.worker = self._submit(request)
        return await trio.lowlevel.wait_task_rescheduled(request.abort)

    async def aclose(self) -> None:
        """Finish every queued request, close the connection and stop its thread.

        Idempotent. The store opens again if it is used afterwards.
        """
        with self._lock:
            worker, self._worker = self._worker, None
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if worker is None:
            await trio.lowlevel.checkpoint()
            return
        stop = _Request(None, session_id=None, writes=False)
        if not worker.submit(stop):
            await trio.lowlevel.checkpoint()
            return

        def abort(raise_cancel: Any) -> trio.lowlevel.Abort:
            # The thread stops whatever happens; wait for it, then raise Cancelled.
            stop.raise_cancel = raise_cancel
            return trio.lowlevel.Abort.FAILED

        await trio.lowlevel.wait_task_rescheduled(abort)
        worker.join()  # it has answered: only its return is left

    # The Store protocol ------------------------------------------------------------

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        snapshot, info = bytes(snapshot), bytes(info)

        def op(conn: sqlite3.Connection, now: float) -> None:
            inserted = conn.execute(
                "INSERT INTO sessions (session_id, snapshot_seq, last_seq, "
                "trimmed_upto, info) VALUES (?, 0, 0, 0, ?) "
                "ON CONFLICT (session_id) DO NOTHING",
                (session_id, info),
            ).rowcount
            if inserted != 1:
                raise _exists_error(session_id)
            conn.execute(
                "INSERT OR REPLACE INTO snapshots (session_id, data) VALUES (?, ?)",
                (session_id, snapshot),
            )

        await self._call(session_id, op, writes=True)

    async def load(self, session_id: str) -> StoredSession | None:
        def op(conn: sqlite3.Connection, now: float) -> StoredSession | None:
            row = conn.execute(
                "SELECT snapshots.data, sessions.snapshot_seq FROM sessions JOIN snapshots "
                "USING (session_id) WHERE session_id = ?",
                (session_id,),
            ).fetchone()
            if row is None:
                return None
            snapshot, snapshot_seq = row
            entries = conn.execute(
                "SELECT seq, data FROM journal WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, snapshot_seq),
            ).fetchall()
            return StoredSession(
                snapshot=snapshot,
                snapshot_seq=snapshot_seq,
                entries=tuple(JournalEntry(seq, data) for seq, data in entries),
            )

        result: StoredSession | None = await self._call(session_id, op, writes=False)
        return result

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        rows = [(session_id, e.seq, bytes(e.data)) for e in entries]
        # Checked before the transaction: the seqs strictly increase among themselves.
        last_seq = _check_entries(session_id, entries, entries[0].seq - 1) if entries else None
        await self._call(
            session_id,
            _append,
            writes=True,
            args=_AppendArgs(session_id, rows, bytes(info), fence, last_seq),
        )

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
        snapshot, info = bytes(snapshot), bytes(info)

        def op(conn: sqlite3.Connection, now: float) -> None:
            row = conn.execute(
                "SELECT snapshot_seq, last_seq, trimmed_upto FROM sessions WHERE session_id = ?",
                (session_id,),
            ).fetchone()
            if row is None:
                raise _not_found_error(session_id)
            snapshot_seq, last_seq, trimmed_upto = row
            _check_fence(conn, session_id, fence, now)
            _check_snapshot_seqs(session_id, seq, trim_upto, snapshot_seq)
            if trim_upto > trimmed_upto:
                conn.execute(
                    "DELETE FROM journal WHERE session_id = ? AND seq <= ?",
                    (session_id, trim_upto),
                )
                trimmed_upto = trim_upto
            conn.execute(
                "UPDATE sessions SET snapshot_seq = ?, last_seq = ?, "
                "trimmed_upto = ?, info = ? WHERE session_id = ?",
                (seq, max(last_seq, seq), trimmed_upto, info, session_id),
            )
            conn.execute(
                "UPDATE snapshots SET data = ? WHERE session_id = ?", (snapshot, session_id)
            )

        await self._call(session_id, op, writes=True)

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        def op(conn: sqlite3.Connection, now: float) -> tuple[int, list[JournalEntry]]:
            row = conn.execute(
                "SELECT trimmed_upto FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
            if row is None:
                raise _not_found_error(session_id)
            entries = conn.execute(
                "SELECT seq, data FROM journal WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, after),
            ).fetchall()
            return row[0], [JournalEntry(seq, data) for seq, data in entries]

        result: tuple[int, list[JournalEntry]] = await self._call(session_id, op, writes=False)
        return result

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        def op(conn: sqlite3.Connection, now: float) -> list[tuple[str, bytes]]:
            rows = conn.execute("SELECT session_id, info FROM sessions ORDER BY session_id")
            return [(session_id, info) for session_id, info in rows]

        result: list[tuple[str, bytes]] = await self._call(None, op, writes=False)
        return result

    async def exists(self, session_id: str) -> bool:
        def op(conn: sqlite3.Connection, now: float) -> bool:
            row = conn.execute(
                "SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
            return row is not None

        result: bool = await self._call(session_id, op, writes=False)
        return result

    async def delete(self, session_id: str) -> bool:
        def op(conn: sqlite3.Connection, now: float) -> bool:
            conn.execute("DELETE FROM journal WHERE session_id = ?", (session_id,))
            conn.execute("DELETE FROM snapshots WHERE session_id = ?", (session_id,))
            conn.execute(
                "UPDATE leases SET owner = NULL, lease_until = 0 WHERE session_id = ?",
                (session_id,),
            )
            deleted = conn.execute(
                "DELETE FROM sessions WHERE session_id = ?", (session_id,)
            ).rowcount
            return bool(deleted == 1)

        result: bool = await self._call(session_id, op, writes=True)
        return result

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        _check_ttl(ttl)

        def op(conn: sqlite3.Connection, now: float) -> Lease | None:
            row = conn.execute(
                _CLAIM,
                {"session_id": session_id, "owner": owner, "until": now + ttl, "now": now},
            ).fetchone()
            return None if row is None else Lease(owner=owner, fence=row[0])

        result: Lease | None = await self._call(session_id, op, writes=True)
        return result

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        _check_ttl(ttl)

        def op(conn: sqlite3.Connection, now: float) -> bool:
            renewed = conn.execute(
                "UPDATE leases SET lease_until = ? WHERE session_id = ? AND owner = ? "
                "AND fence = ? AND lease_until >= ?",
                (now + ttl, session_id, lease.owner, lease.fence, now),
            ).rowcount
            return bool(renewed == 1)

        result: bool = await self._call(session_id, op, writes=True)
        return result

    async def release(self, session_id: str, lease: Lease) -> None:
        def op(conn: sqlite3.Connection, now: float) -> None:
            conn.execute(
                "UPDATE leases SET owner = NULL, lease_until = 0 "
                "WHERE session_id = ? AND owner = ? AND fence = ?",
                (session_id, lease.owner, lease.fence),
            )

        await self._call(session_id, op, writes=True)
