"""``SQLiteStore``: the embedded default store, one SQLite file in WAL mode.

One OS thread owns the connection and serves requests from a queue, so the
trio thread never blocks on the disk. Each time it wakes it takes everything
queued and runs it in one transaction (``BEGIN IMMEDIATE ... COMMIT``): the
appends of many sessions share one fsync'd commit, and one failing request does
not fail the others. A batch's appends go in with one statement per table; if
any of them is refused (or collides with rows written behind the store's
back), they run again one by one, each in its own savepoint, as every other
request does, so that a failure is its own session's only. The callers are
answered after the commit, with one wakeup per trio run.

Leases live in the same file, so they work across processes: a claim is a
single upsert, and a fenced write checks the token inside the transaction
that writes, while holding the database's write lock.

Which processes may open the file is decided by an advisory lock (``flock``)
on a side file, ``<path>.lock``, taken when the store first opens the file
and held until :meth:`SQLiteStore.aclose`: exclusive by default, so that a
second process is refused with a clear error instead of both writing the same
sessions; shared with ``shared=True``, in every process, which then turn
leases on. Stores of one process share its lock. An exclusive lock's file is
removed when its last store closes; a shared one's stays. ``readonly=True``
takes no lock and writes nothing. (The lock, and the checks of the files made
before opening them, are in ``_sqlite_files``.)

A file is created with its tables under a temporary name and linked into
place, so a file at ``path`` always holds them: one that exists without them
(truncated to 0 bytes, or another program's database) is refused, never read
as an empty store.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import sqlite3
import threading
import time
import urllib.parse
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple, cast

import attrs
import outcome
import trio

from .._codec import MAX_SEQ
from .._errors import Advice, AdviceKind, StoreConfigurationError, StoreError, advised
from .._listing import after_not_found, info_activity, page_of
from .._names import name_bytes, stored_name
from ._base import JournalEntry, Lease, StoredSession
from ._memory import (
    _check_entries,
    _check_snapshot_seqs,
    _check_stored_entries,
    _check_stored_seq,
    _check_ttl,
    _exists_error,
    _fence_problem,
    _fenced_out_error,
    _not_found_error,
    _stored_corrupt,
)
from ._sqlite_files import (
    _acquire_lock,
    _check_lock,
    _check_no_orphan_wal,
    _check_path,
    _check_writable,
    _file_stamp,
    _OpenError,
    _RefusedError,
    _release_lock,
)

__all__ = ["SQLiteStore", "SQLiteStoreStatistics"]

_SCHEMA_VERSION: Final = 2
# Version 2 added sessions.activity (the info's updated_at, in microseconds) and
# its index, for listings newest first a page at a time; see _migrate.
_ACTIVITY_INDEX: Final = (
    "CREATE INDEX IF NOT EXISTS sessions_by_activity ON sessions (activity, session_id)"
)
_SCHEMA: Final = (
    # The snapshot lives in a table of its own: appends update a session's row
    # (last_seq, info), and that must not rewrite a large snapshot each time.
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id TEXT PRIMARY KEY NOT NULL,
        snapshot_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        trimmed_upto INTEGER NOT NULL,
        info BLOB NOT NULL,
        activity INTEGER NOT NULL DEFAULT 0
    )""",
    _ACTIVITY_INDEX,
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
    "PRAGMA user_version = 2",  # _SCHEMA_VERSION
)
# PRAGMA values cannot be bound parameters: only these fixed statements are run.
_SYNCHRONOUS: Final = {
    "OFF": "PRAGMA synchronous = OFF",
    "NORMAL": "PRAGMA synchronous = NORMAL",
    "FULL": "PRAGMA synchronous = FULL",
    "EXTRA": "PRAGMA synchronous = EXTRA",
}
_MAX_BATCH: Final = 1024
# A session's name as listings read it: as bytes, decoded in Python (see _named), so
# that a name that damage left not UTF-8 fails no listing. _BOUND matches a name
# bound as its bytes (see _key), which a damaged name's str cannot be bound as text.
_NAME: Final = "CAST(session_id AS BLOB)"
_BOUND: Final = "CAST(? AS TEXT)"

# The workers of this process that were told to stop and still run (they finish what
# was queued before the stop), by the file's absolute path: a worker started on the
# same file waits for them before it serves anything (see ``_Worker._run``).
# Reentrant: the finalizer of a dropped store (``stop_nowait``) takes it too, and a
# collection started by an allocation under it can run that finalizer on this thread.
_STOPPING: Final[dict[str, set[_Worker]]] = {}
_STOPPING_LOCK: Final = threading.RLock()

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
    """One call waiting for the connection's thread; ``op is None`` means: stop.

    The thread sets ``result`` before answering: the call's outcome, or ``None`` for
    a call that returned ``None`` (no object made for it: a thousand appends answered
    at once would otherwise make a thousand)."""

    __slots__ = (
        "args",
        "op",
        "raise_cancel",
        "result",
        "session_id",
        "state",
        "task",
        "timer",
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
        self.result: outcome.Outcome[Any] | None = None
        if waiter:
            self.token: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
            self.task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        else:
            self.token = self.task = None

    def __call__(self, raise_cancel: Any) -> trio.lowlevel.Abort:
        """The abort function of the waiting caller (runs on its trio thread). The
        request itself is passed as that function: a bound method would be one more
        object for each waiting call.

        A request the thread runs already is waited for (its commit, if it writes,
        lands), but for a bounded time: a disk that stalls (a frozen file system, a
        hung network volume) would hold its caller, and a shutdown, for ever. After
        ``busy_timeout`` and ``_STALL_GRACE`` seconds more, the caller is cancelled
        all the same (a write's outcome is then unknown, as after a timeout of any
        store), and the thread's answer, if it ever comes, is dropped."""
        worker = self.worker
        assert worker is not None
        if worker.withdraw(self):
            return trio.lowlevel.Abort.SUCCEEDED
        self.raise_cancel = raise_cancel
        # (the bound is real time, a thread's: the disk does not follow a test's clock)
        timer = self.timer = threading.Timer(worker._busy_timeout + _STALL_GRACE, _give_up, (self,))
        timer.daemon = True
        timer.start()
        return trio.lowlevel.Abort.FAILED


#: How long past ``busy_timeout`` a cancelled caller waits for the request the thread
#: runs (a write's commit) before it gives up on a stalled disk (see ``_Request``).
_STALL_GRACE: Final = 5.0


def _give_up(request: _Request) -> None:
    """(On its timer's thread.) Cancel the caller of ``request``, cancelled while the
    connection's thread ran it, which that thread has not answered in time."""
    assert request.token is not None
    with contextlib.suppress(trio.RunFinishedError):
        request.token.run_sync_soon(_give_up_now, request)


def _give_up_now(request: _Request) -> None:
    task = request.task
    if task is not None:  # (not answered meanwhile: _deliver clears it)
        request.task = None
        trio.lowlevel.reschedule(task, outcome.capture(request.raise_cancel))


#: How long ago (in ns) a directory's entries must have last changed for its stamp to
#: stand for them (see ``_Worker._check_files``).
_QUIET_NS: Final = 2_000_000_000

#: The size, in bytes, that the write-ahead log is truncated to after a checkpoint.
_WAL_SIZE_LIMIT: Final = 4 * 1024 * 1024

#: How long, in seconds, the checkpoint that follows a delete waits for a reader of an
#: older snapshot (another process's) or another process's write to finish (at most
#: ``busy_timeout``), and how long after a checkpoint that could not empty the ``-wal``
#: it is tried again (see ``_Worker._erase``).
_ERASE_PATIENCE: Final = 0.05
_ERASE_RETRY: Final = 1.0


def _deliver(answered: list[_Request]) -> None:
    # Runs on the callers' trio thread, so it never races the abort function.
    reschedule = trio.lowlevel.reschedule
    for request in answered:
        task = request.task
        if task is None:  # a close that stopped waiting (see SQLiteStore.aclose)
            continue
        if request.raise_cancel is not None:
            request.task = None  # (answered: its stall bound has nothing to do)
            request.timer.cancel()  # (set with raise_cancel: see _Request.__call__)
            reschedule(task, outcome.capture(request.raise_cancel))
        elif request.result is None:
            reschedule(task)  # (trio's Value(None), made as the task runs)
        else:
            reschedule(task, request.result)


def _answer(answered: Sequence[_Request]) -> None:
    """Wake every caller with its ``result``: one hop per trio run, not one per request."""
    by_token: dict[trio.lowlevel.TrioToken, list[_Request]] = {}
    for request in answered:
        token = request.token
        if token is not None:
            group = by_token.get(token)
            if group is None:
                group = by_token[token] = []
            group.append(request)
    for token, group in by_token.items():
        # The caller's run is over (it was interrupted): nobody is left to answer.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(_deliver, group)


def _fail(path: str, batch: list[_Request], exc: BaseException) -> None:
    """Answer every request of a transaction that failed as a whole."""
    for request in batch:
        request.result = outcome.Error(_store_error(path, request, exc))
    _answer(batch)


def _store_error(path: str, request: _Request, exc: BaseException) -> StoreError:
    about = f"session {request.session_id!r}: " if request.session_id is not None else ""
    if isinstance(exc, _OpenError):
        kind = StoreConfigurationError if isinstance(exc, _RefusedError) else StoreError
        error = kind(f"{about}{exc}", session_id=request.session_id)
        error.__cause__ = exc.__cause__
        return error
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
        self._shared = store.shared
        self._readonly = store.readonly
        self._locked = False  # this worker holds (its share of) the process's lock
        self._immutable = False  # a read-only connection that ignores any WAL (see below)
        self._stamp: tuple[int, ...] | None = None  # the file as that connection opened it
        self._file_id: tuple[int, int] | None = None  # the file a writable connection opened
        self._directory = os.path.dirname(os.path.abspath(self._path))
        # the directory's stamp when a check last found every file in place (see _check_files)
        self._quiet_directory: tuple[int, ...] | None = None
        self._lock_key: str | None = None
        self._counters = store._counters
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[_Request] = deque()
        self.queued = 0
        #: When to try again to empty the -wal of what a delete left in it (None: empty)
        self._erase_at: float | None = None
        self._stopping = False
        self._waiting = False  # the thread waits for requests (under _lock)
        self._key = os.path.abspath(self._path)
        with _STOPPING_LOCK:  # (to wait for before serving: the writes made before ours)
            self._after = tuple(_STOPPING.get(self._key, ()))
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
                first = {self}  # (made before the lock: see _STOPPING_LOCK)
                with _STOPPING_LOCK:
                    stopping = _STOPPING.setdefault(self._key, first)
                    if stopping is not first:
                        stopping.add(self)
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
        """The requests queued, waiting for one (an empty batch: a checkpoint that a
        delete left to do is due, see ``_erase``)."""
        with self._lock:
            while not self._queue:
                erase_at = self._erase_at
                now = time.monotonic()
                if erase_at is not None and erase_at <= now:
                    return []
                self._waiting = True
                self._wakeup.wait(None if erase_at is None else erase_at - now)
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
        # A worker of this process on the same file that is still finishing the writes
        # queued before its store was closed (an aclose cancelled, a store dropped)
        # writes first: a store opened again at once then writes in the order the
        # writes were made. Bounded, as a lock held by another connection would be.
        deadline = time.monotonic() + self._busy_timeout
        for earlier in self._after:
            earlier._thread.join(max(0.0, deadline - time.monotonic()))
        self._after = ()
        try:
            while True:
                batch = self._take_batch()
                stop = [r for r in batch if r.op is None]
                work = [r for r in batch if r.op is not None]
                if work:
                    conn = self._serve(conn, work)
                    # (the requests hold their data: the next wait must not keep them)
                    del batch, work
                elif not stop and self._erase_due():  # (tried again while idle)
                    if conn is None:  # (closed: its close emptied the -wal it could)
                        self._erase_at = None
                    else:
                        self._erase(conn)
                if stop:
                    # Nothing can be queued after a stop request.
                    if conn is not None:
                        self._close(conn)
                        conn = None
                    self._unlock()
                    _answer(stop[:1])
                    return
        finally:
            if conn is not None:
                self._close(conn)
            self._unlock()
            with _STOPPING_LOCK:
                stopping = _STOPPING.get(self._key)
                if stopping is not None:
                    stopping.discard(self)
                    if not stopping:
                        del _STOPPING[self._key]

    def _close(self, conn: sqlite3.Connection) -> None:
        """Close the connection. If the file it opened is no longer at the path (deleted
        or replaced), its writes are checkpointed into that file first: the ``-wal`` left
        at the path then holds nothing of it, for SQLite to read into the file that is
        made or put there (where it would bring deleted sessions back, or corrupt it)."""
        if self._holds_unwritten():
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()

    def _holds_unwritten(self) -> bool:
        """Whether this writable connection is the only way to writes that belong in a
        file: its file is no longer at the path, or its ``-wal`` was deleted (a deleted
        ``-wal`` lives on only in the connection, and a checkpoint cut short, by a full
        disk, say, leaves the file half written until it is finished from there)."""
        if self._file_id is None:
            return False
        return self._moved() or not os.path.exists(f"{self._path}-wal")

    def _moved(self) -> bool:
        """Whether the file this writable connection opened is no longer at the path."""
        try:
            st = os.stat(self._path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._file_id

    def _check_files(self, conn: sqlite3.Connection) -> sqlite3.Connection | None:
        """Before a transaction on an open writable connection: refuse to go on with a
        file that is no longer at the path; reopen if its ``-wal`` or ``-shm`` was
        deleted (the connection would write to a deleted ``-wal`` that a crash loses,
        and beside a ``-shm`` that another connection does not share), once what it
        holds is checkpointed into the file. The connection to use, or None: reopen.

        These files' names are entries of one directory: while no entry of it was
        added, removed or renamed since the last check (its time stamps say so), one
        stat of the directory stands for the four stats of the check.
        """
        path = self._path
        try:
            st = os.stat(self._directory)
        except OSError:
            stamp = None
        else:
            stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            if stamp == self._quiet_directory:
                return conn
        self._quiet_directory = None
        if self._locked:
            _check_lock(path, self._lock_key)
        if self._moved():
            raise _OpenError(
                f"the sqlite store's file {path!r} was deleted or replaced while the store"
                " had it open, so the store writes nothing more to it (nothing was written"
                " now): put the file back at that path, or close the store (restart the"
                " process) to open the file that is there now; what the store wrote before"
                " is in the file it had open"
            )
        if os.path.exists(f"{path}-wal") and os.path.exists(f"{path}-shm"):
            if stamp is not None and time.time_ns() - stamp[3] > _QUIET_NS:
                # a change after this check gets a later stamp, however coarse the file
                # system's clock; a directory changed more recently is checked again
                self._quiet_directory = stamp
            return conn
        (busy, _, _) = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise sqlite3.OperationalError(
                "its -wal or -shm file was deleted while it was open, and what the deleted"
                " -wal holds could not be written back into the file yet (a reader was busy)"
            )
        conn.close()
        return None

    def _unlock(self) -> None:
        if self._locked:
            self._locked = False
            _release_lock(self._lock_key)

    def _open(self) -> sqlite3.Connection:
        """Open the file: lock it for this process, create it if it does not exist, and
        check that it is a sessionactors store this version reads."""
        path = self._path
        _check_path(path)
        if self._readonly:
            return self._open_readonly()
        if not self._locked:
            # Held until the store is closed, across reconnections: another process
            # must not slip in between.
            self._lock_key = _acquire_lock(path, shared=self._shared)
            self._locked = True
        if not os.path.exists(path):
            _check_no_orphan_wal(path)
            _create(path)
        elif os.path.getsize(path) == 0:
            raise _RefusedError(_not_ours(path, _EMPTY))
        _check_writable(path)
        conn = sqlite3.connect(
            path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=True
        )
        try:
            st = os.stat(path)
            self._file_id = (st.st_dev, st.st_ino)
            self._quiet_directory = None
            if _check_schema(conn, path) < _SCHEMA_VERSION:
                _migrate(conn)
            (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot use WAL mode (journal mode is {mode!r})")
            conn.execute(self._synchronous)
            # a delete overwrites what it deletes with zeros (on an SQLite built without
            # SQLITE_SECURE_DELETE, the upstream default, it would stay in free pages)
            conn.execute("PRAGMA secure_delete = ON")
            # the -wal file shrinks back after a burst of large writes once checkpointed
            # (SQLite otherwise keeps it at its largest size while the store is open)
            conn.execute(f"PRAGMA journal_size_limit = {_WAL_SIZE_LIMIT}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _open_readonly(self) -> sqlite3.Connection:
        path = self._path
        if not os.path.exists(path):
            raise _OpenError(
                f"the sqlite store at {path!r} does not exist; a read-only store opens only"
                " an existing file"
            )
        if os.path.getsize(path) == 0:
            raise _RefusedError(_not_ours(path, _EMPTY))
        # Nothing of the file may change, -wal and -shm included. While a process has
        # the file open (its -shm exists), readonly_shm=1 maps that -shm read-only:
        # plain mode=ro would record its read position there. With no -shm, no process
        # has the file open and the WAL is checkpointed into it: immutable=1 reads it
        # without creating a -wal or -shm, and _serve reopens the connection once a
        # -shm appears (a writer opened the file), before its next transaction.
        self._immutable = not os.path.exists(f"{path}-shm")
        self._stamp = _file_stamp(path)
        mode = "immutable=1" if self._immutable else "readonly_shm=1"
        uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro&{mode}"
        conn = sqlite3.connect(
            uri,
            uri=True,
            timeout=self._busy_timeout,
            isolation_level=None,
            check_same_thread=True,
        )
        try:
            _check_schema(conn, path, readonly=True)
        except BaseException:
            conn.close()
            raise
        return conn

    def _file_changed(self) -> bool:
        """Whether a writer has opened the file, or changed it, since it was opened
        immutable."""
        path = self._path
        return os.path.exists(f"{path}-shm") or _file_stamp(path) != self._stamp

    def _serve(
        self, conn: sqlite3.Connection | None, batch: list[_Request]
    ) -> sqlite3.Connection | None:
        """Run ``batch`` in one transaction and answer every request; return the connection."""
        writes = any(r.writes for r in batch)
        try:
            if conn is not None and self._immutable and self._file_changed():
                # A writer has the file open (read it through its WAL from now on), or
                # came and went since: an immutable connection would not see its writes.
                conn.close()
                conn = None
            if conn is not None and not self._readonly:
                conn = self._check_files(conn)
            if conn is None:
                conn = self._open()
            conn.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
            appended = self._run_all(conn, batch)
            conn.execute("COMMIT")
        except Exception as exc:
            # The whole transaction is lost (or the file could not be opened): fail
            # every request, and start afresh with a new connection next time (but
            # with the same one while it holds writes that are not in the file at the
            # path: its file may come back, its deleted -wal's checkpoint may finish).
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                if self._holds_unwritten():
                    _fail(self._path, batch, exc)
                    return conn
                conn.close()
            _fail(self._path, batch, exc)
            return None
        with self._counters.lock:
            if writes:
                self._counters.commits += 1
            self._counters.appends += appended
            self._counters.largest_batch = max(self._counters.largest_batch, len(batch))
        deletes = [r for r in batch if r.op is _delete]
        if not deletes:
            _answer(batch)
            if self._erase_due():
                self._erase(conn)
            return conn
        _answer([r for r in batch if r.op is not _delete])
        self._erase(conn)  # before the deletes are answered: they are erased then
        _answer(deletes)
        return conn

    def _erase_due(self) -> bool:
        """Whether a checkpoint that a delete left to do is to be tried again now."""
        return self._erase_at is not None and self._erase_at <= time.monotonic()

    def _erase(self, conn: sqlite3.Connection) -> None:
        """Empty the ``-wal`` after a delete: a checkpoint writes the pages the delete
        freed, overwritten with zeros (``secure_delete``), into the file, and truncates
        the ``-wal``, whose older frames still hold what was deleted. Best effort: a
        reader of an older snapshot (another process's, reading the file) keeps the
        frames it may read, and another process's write holds the file; they are waited
        for ``_ERASE_PATIENCE`` seconds, then the checkpoint is tried again every
        ``_ERASE_RETRY`` seconds (after the next transaction, or when idle) until it
        empties the ``-wal``. Closing the file's last connection empties it too."""
        patience = int(min(self._busy_timeout, _ERASE_PATIENCE) * 1000)
        try:
            conn.execute(f"PRAGMA busy_timeout = {patience}")
            try:
                (busy, _, _) = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
        except sqlite3.Error:
            busy = 1  # (the next transaction meets the problem, and says so)
        self._erase_at = time.monotonic() + _ERASE_RETRY if busy else None

    def _run_all(self, conn: sqlite3.Connection, batch: list[_Request]) -> int:
        """Run every request in order and set its ``result``; consecutive plain appends
        run in bulk. How many appends succeeded."""
        appended = 0
        run: list[_Request] = []
        for request in batch:
            if _bulk_append(request):
                run.append(request)
                continue
            if run:
                appended += self._run_appends(conn, run)
                run = []
            request.result = result = self._run_one(conn, request)
            appended += request.op is _append and result.__class__ is not outcome.Error
        if run:
            appended += self._run_appends(conn, run)
        return appended

    def _run_appends(self, conn: sqlite3.Connection, run: list[_Request]) -> int:
        if len(run) > 1 and _append_all(conn, [cast(_AppendArgs, r.args) for r in run]):
            for request in run:
                request.result = None
            return len(run)
        appended = 0
        for request in run:
            request.result = result = self._run_one(conn, request)
            appended += result.__class__ is not outcome.Error
        return appended

    def _run_one(self, conn: sqlite3.Connection, request: _Request) -> outcome.Outcome[Any] | None:
        """Run one request in a savepoint of its own: its failure undoes it alone, and
        fails its caller alone, under its own session's name. Its outcome (``None``
        for the value ``None``)."""
        assert request.op is not None
        conn.execute("SAVEPOINT request")
        try:
            value = request.op(conn, time.time(), *request.args)
        except sqlite3.Error as exc:
            # Undo just this request; if that is impossible, the error aborts the batch.
            conn.execute("ROLLBACK TO request")
            conn.execute("RELEASE request")
            if request.op is _append and isinstance(exc, sqlite3.IntegrityError):
                return outcome.Error(_append_conflict(conn, cast(_AppendArgs, request.args)))
            return outcome.Error(_store_error(self._path, request, exc))
        except Exception as exc:
            conn.execute("ROLLBACK TO request")
            conn.execute("RELEASE request")
            return outcome.Error(exc)
        conn.execute("RELEASE request")
        return None if value is None else outcome.Value(value)


_TABLES: Final = ("journal", "leases", "sessions", "snapshots")
_EMPTY: Final = (
    "the file is empty (0 bytes): a store truncated, or a file made empty for it (a store"
    " file is never empty: it is created with its tables); if it was made empty, delete it"
    " and the store creates it"
)
# SQLite's primary result codes (an error's sqlite_errorcode, extended codes included,
# masked with 0xFF): the file is not a database (whatever a retry does); the file reads
# as damaged (a reader that takes no lock, as a read-only store may, can also meet a
# file that another process writes so for a moment).
_SQLITE_CORRUPT: Final = 11
_SQLITE_NOTADB: Final = 26


def _not_ours(path: str, problem: str) -> str:
    return (
        f"the sqlite store at {path!r} is not a sessionactors store: {problem}; nothing was"
        " written to it. Restore the file from a backup, or pass the path of a store (or of"
        " a file that does not exist yet: it is created)"
    )


def _damaged(path: str, exc: sqlite3.Error, *, readonly: bool) -> str:
    lasting = (
        "; a read-only reader may meet a file that another process is writing so for a"
        " moment: if a retry meets it too, the file is damaged."
        if readonly
        else ": the file is damaged."
    )
    return (
        f"the sqlite store at {path!r} is damaged: SQLite reads it as corrupt ({exc})"
        f"{lasting} Check it with sqlite3 {path!r} 'PRAGMA integrity_check', and restore"
        " it from a backup; nothing was written to it"
    )


def _check_schema(conn: sqlite3.Connection, path: str, *, readonly: bool = False) -> int:
    """Refuse a file that is not a sessionactors store this version reads; its version
    (older ones are migrated when opened for writing, and read as they are). A file
    that reads as damaged is refused for good by a store that writes it (which reads
    it under SQLite's locks), and with a ``StoreError`` to retry by a ``readonly`` one
    (which may meet a file that another process writes so for a moment)."""
    try:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        tables = sorted(
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (?, ?, ?, ?)",
                _TABLES,
            )
        )
    except sqlite3.DatabaseError as exc:
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        if code == _SQLITE_CORRUPT:
            kind = _OpenError if readonly else _RefusedError
            raise kind(_damaged(path, exc, readonly=readonly)) from exc
        if code != _SQLITE_NOTADB:
            raise  # busy, or the disk failed: not foreign, and perhaps not for long
        raise _RefusedError(_not_ours(path, f"it is not an SQLite database ({exc})")) from exc
    if version > _SCHEMA_VERSION:
        raise _RefusedError(
            f"the sqlite store at {path!r} has schema version {version}: a newer version of"
            f" sessionactors wrote it, and this one reads versions up to {_SCHEMA_VERSION};"
            " nothing was written to it. Upgrade sessionactors (to the version that wrote"
            " the file, or a later one), or pass the path of another store"
        )
    if version not in (1, _SCHEMA_VERSION) or tuple(tables) != _TABLES:
        raise _RefusedError(_not_ours(path, "it does not hold the tables of one"))
    return int(version)


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a version 1 file to version 2: every session's activity time, read from
    its info, in a new column with an index. One transaction, under the write lock,
    so that of several processes opening the file one migrates it."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version == 1:
            conn.execute("ALTER TABLE sessions ADD COLUMN activity INTEGER NOT NULL DEFAULT 0")
            rows = conn.execute("SELECT rowid, info FROM sessions").fetchall()
            conn.executemany(  # (by rowid: a name that is not UTF-8 does not fail it)
                "UPDATE sessions SET activity = ? WHERE rowid = ?",
                [(info_activity(info), rowid) for rowid, info in rows if isinstance(info, bytes)],
            )
            conn.execute(_ACTIVITY_INDEX)
            conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _named(rows: Iterator[tuple[bytes, bytes]]) -> list[tuple[str, bytes]]:
    """``(name, info)`` of rows read with ``_NAME``: a name that is not UTF-8 (damage)
    decoded with ``surrogateescape``, which listings leave out (see ``damaged_name``)."""
    return [(stored_name(raw), info) for raw, info in rows]


def _key(session_id: str) -> bytes:
    """``session_id``'s bytes, to bind with ``_BOUND``; a damaged name's own bytes."""
    return name_bytes(session_id)


def _create(path: str) -> None:
    """Create the store's file with its tables, all at once.

    The tables are made in a file of another name, which is then linked to
    ``path`` only if nothing is there yet: a file at ``path`` always holds
    them (a crash leaves at most the temporary file), and of two processes
    creating the store at once, one makes it and the other uses it.
    """
    temporary = f"{path}.new-{os.getpid()}-{secrets.token_hex(4)}"
    try:  # (whatever fails, a full disk included, the temporary file goes)
        conn = sqlite3.connect(temporary, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute("COMMIT")
        finally:
            conn.close()  # the last connection: the WAL is written back and removed
        try:
            os.link(temporary, path)
        except FileExistsError:
            return  # made by another process meanwhile
        except OSError:  # pragma: no cover - a file system without hard links
            if os.path.exists(path):
                return
            os.rename(temporary, path)
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(directory)  # the new name is durable before anything is written to it
        finally:
            os.close(directory)
    finally:
        for leftover in (temporary, f"{temporary}-wal", f"{temporary}-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


def _delete(conn: sqlite3.Connection, now: float, session_id: str) -> bool:
    """``SQLiteStore.delete`` in the transaction (its worker then empties the ``-wal``)."""
    key = (_key(session_id),)  # (a damaged name is deleted by its bytes)
    conn.execute(f"DELETE FROM journal WHERE session_id = {_BOUND}", key)
    conn.execute(f"DELETE FROM snapshots WHERE session_id = {_BOUND}", key)
    conn.execute(
        f"UPDATE leases SET owner = NULL, lease_until = 0 WHERE session_id = {_BOUND}", key
    )
    deleted = conn.execute(f"DELETE FROM sessions WHERE session_id = {_BOUND}", key)
    return bool(deleted.rowcount == 1)


def _trimmed_upto(conn: sqlite3.Connection, session_id: str) -> int:
    """The seq up to which the stored session's journal was trimmed."""
    row = conn.execute(
        "SELECT trimmed_upto FROM sessions WHERE session_id = ?", (session_id,)
    ).fetchone()
    if row is None:
        raise _not_found_error(session_id)
    return _check_stored_seq(session_id, row[0], "the journal's trimmed seq")


def _append_conflict(conn: sqlite3.Connection, args: _AppendArgs) -> StoreError:
    """The error for an append whose rows collide with journal rows already stored,
    though above the session's last seq: rows written behind the store's back."""
    session_id = args.session_id
    (highest,) = conn.execute(
        "SELECT max(seq) FROM journal WHERE session_id = ?", (session_id,)
    ).fetchone()
    return advised(
        StoreError,
        f"session {session_id!r}: the journal already holds an entry at seq"
        f" {args.entries[0].seq} or above (up to {highest}), above the session's last seq:"
        " rows were written behind the store's back; nothing was written. Restore the"
        " file from a backup, or delete the session with ",
        Advice(kind=AdviceKind.DELETE),
        session_id=session_id,
    )


def _fspath(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if isinstance(path, str) and path[:9].lower() == "sqlite://":
        # the command line's store URL where a path belongs: it would be read as a
        # file in a directory named 'sqlite:', and fail first over that lock file
        hint = f"SQLiteStore({path[10:]!r})" if path[9:10] == "/" else "SQLiteStore('sessions.db')"
        raise ValueError(
            f"SQLiteStore takes a file path, not a URL like {path!r}: pass {hint} "
            "(sqlite:/// URLs are for the command line's store: --store, --store-file or "
            "SESSIONACTORS_STORE)"
        )
    return path


def _upper(value: str) -> str:
    return value.upper()


def _check_synchronous(_: object, __: object, value: str) -> None:
    if value not in _SYNCHRONOUS:
        raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS)}, not {value!r}")


def _check_flag(_: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if value.__class__ is not bool:
        raise TypeError(f"{attribute.name} must be True or False, not {value!r}")


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
    entries: Sequence[JournalEntry]  # (made rows in the thread: see _rows)
    info: bytes
    fence: int | None
    last_seq: int | None  # None: no entries, only the info changes
    activity: int  # the info's (see _listing.info_activity)


def _append(
    conn: sqlite3.Connection,
    now: float,
    session_id: str,
    entries: Sequence[JournalEntry],
    info: bytes,
    fence: int | None,
    last_seq: int | None,
    activity: int,
) -> None:
    """``SQLiteStore.append`` in the transaction (in a savepoint: see ``_Worker._run_one``)."""
    if fence is not None:
        if not conn.execute(
            "SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)
        ).fetchone():
            raise _not_found_error(session_id)
        _check_fence(conn, session_id, fence, now)
    if last_seq is None:
        updated = conn.execute(
            "UPDATE sessions SET info = ?, activity = ? WHERE session_id = ? RETURNING 1",
            (_blob(info), activity, session_id),
        ).fetchone()
    else:
        updated = conn.execute(
            "UPDATE sessions SET last_seq = ?, info = ?, activity = ? "
            "WHERE session_id = ? AND last_seq < ? RETURNING 1",
            (last_seq, _blob(info), activity, session_id, entries[0].seq),
        ).fetchone()
    if updated is None:  # nothing was written: say why
        row = conn.execute(
            "SELECT last_seq FROM sessions WHERE session_id = ?", (session_id,)
        ).fetchone()
        if row is None:
            raise _not_found_error(session_id)
        _check_entries(session_id, entries, row[0])
        raise AssertionError("unreachable: the seqs were checked")  # pragma: no cover
    conn.executemany(
        "INSERT INTO journal (session_id, seq, data) VALUES (?, ?, ?)", _rows(session_id, entries)
    )


#: Blobs up to this size are bound as a copy (see ``_blob``).
_COPY_BLOB: Final = 4096


def _blob(data: bytes) -> bytes | bytearray:
    """``data`` as Python's ``sqlite3`` binds it fastest: the same BLOB either way, but
    a ``bytes`` parameter is first offered to the adapter registry, which costs about
    as much as copying 4 KB (Python 3.11: two failed attribute lookups, one of which
    formats an error message), and a ``bytearray`` is bound as it is."""
    return bytearray(data) if len(data) <= _COPY_BLOB else data


def _rows(
    session_id: str, entries: Sequence[JournalEntry]
) -> Iterator[tuple[str, int, bytes | bytearray]]:
    """The journal rows of an append's entries (of bytes: see ``append``), made as SQLite
    takes them (a turn waiting for its commit holds its entries, not rows made of them
    too)."""
    for entry in entries:
        yield session_id, entry.seq, _blob(entry.data)


def _bulk_append(request: _Request) -> bool:
    """An append that can join others in one statement: entries, and no fence to check."""
    if request.op is not _append:
        return False
    args = cast(_AppendArgs, request.args)
    return args.fence is None and args.last_seq is not None


def _append_all(conn: sqlite3.Connection, appends: list[_AppendArgs]) -> bool:
    """Run many fence-free appends with one statement per table; False (and nothing
    written) if any of them is refused or collides with a stored row, for the caller
    to run them one by one."""
    conn.execute("SAVEPOINT appends")
    updated = conn.executemany(
        "UPDATE sessions SET last_seq = ?, info = ?, activity = ? "
        "WHERE session_id = ? AND last_seq < ?",
        # (rows made as SQLite takes them: each is gone before the next is made)
        ((a.last_seq, _blob(a.info), a.activity, a.session_id, a.entries[0].seq) for a in appends),
    ).rowcount
    if updated == len(appends):
        try:
            conn.executemany(
                "INSERT INTO journal (session_id, seq, data) VALUES (?, ?, ?)",
                (row for a in appends for row in _rows(a.session_id, a.entries)),
            )
        except sqlite3.IntegrityError:
            pass  # rows written behind the store's back: one by one, each fails alone
        else:
            conn.execute("RELEASE appends")
            return True
    conn.execute("ROLLBACK TO appends")
    conn.execute("RELEASE appends")
    return False


@attrs.define(eq=False, repr=False)
class SQLiteStore:
    """A :class:`~sessionactors.stores.Store` in one SQLite file (WAL mode).

    ``SQLiteStore("sessions.db")`` does no I/O: the file is opened (and created,
    with its tables) on first use, and opened again on use after :meth:`aclose`,
    so one store object can be made before ``trio.run`` and serve successive
    runs. ``path`` is a file's path: a ``sqlite:///`` URL, the command line's
    ``--store`` form, raises ``ValueError`` saying which path to pass.
    ``synchronous`` is SQLite's setting (``"FULL"``: every commit is fsync'd;
    ``"NORMAL"`` trades the durability of the last commits on power loss for
    speed). ``busy_timeout`` is how long, in seconds, to wait for
    another process's write lock before failing with ``StoreError``. The
    ``-wal`` file beside it shrinks back to at most 4 MiB after a burst of large
    writes, once they are checkpointed into the file.

    One process writes the file by default: the store locks it (an advisory
    lock on ``<path>.lock``, held until :meth:`aclose`), and a store in a
    second process fails its first call with ``StoreError`` saying so (a lock
    file deleted meanwhile is taken again before the next transaction; if
    another process took it first, this store writes nothing more). Stores
    of one process share the lock, but one registry without leases writes the
    file at a time: a second one is refused, through this store object or
    another of the same file (see ``writes_to``). With ``shared=True`` in every process,
    several processes may write the file: ``shared_by_workers`` is then true,
    so the registry turns leases on, and leases and fencing keep a session
    live in one of them at a time. ``readonly=True`` opens an existing file
    for reading only (SQLite's ``mode=ro``), takes no lock, so it works while
    another process writes the file, changes no byte of the file or of its
    ``-wal`` and ``-shm`` files (and creates neither), and refuses every write
    with ``StoreError``: for operators' tools.

    A path that no retry can open fails every call with
    ``StoreConfigurationError``, which names the file and says what to do,
    before anything is written: a directory or a file in a directory that does
    not exist (it is not made); a path that holds a NUL character or is a loop of
    symbolic links; a file that exists but is not a sessionactors
    store (text, truncated to 0 bytes, or another program's database: it is
    never read as an empty store); a store of a newer schema version than this
    version reads; unless the store is ``readonly=True``, a file (or its
    ``-wal`` or ``-shm``, or its directory) that this process may not write;
    a ``-wal`` with writes in it beside a path where no file is (its file was
    deleted or moved away), which is not read into a new file; a store file that
    SQLite reads as damaged (``SQLITE_CORRUPT``: the message says to check it
    with ``PRAGMA integrity_check`` and to restore it from a backup). A
    ``readonly=True`` store raises ``StoreError`` for a damaged file instead, to
    be retried: it reads without SQLite's locks while no other process has the
    file open, and so may meet a file that a process that opens it meanwhile
    writes as damaged for a moment (``sessions tail`` tries again for up to 60
    seconds, as it does a store that does not answer).

    A file deleted or replaced while the store has it open is not written to:
    every call fails with ``StoreError`` until the file is back at its path or
    the store is closed (it then opens what is at the path). A ``-wal`` or
    ``-shm`` deleted while it is open is noticed before the next transaction:
    what the deleted ``-wal`` held is written into the file, and the files are
    opened again.

    :meth:`delete` leaves nothing of the session in the file or its ``-wal``:
    SQLite overwrites the deleted rows with zeros (the store sets ``PRAGMA
    secure_delete`` on its connection: an SQLite built without it, the upstream
    default, would leave them in the file's free pages), and before it returns
    the ``-wal``, whose older frames still hold them, is checkpointed into the
    file and truncated. While another process reads the file on an older snapshot
    (a backup under way, say), SQLite keeps the frames that reader may read: the
    checkpoint waits 50 ms for it, then is tried again every second until the
    ``-wal`` is empty (closing the store empties it too). The file does not
    shrink: the zeroed pages are reused (``VACUUM`` gives them back).

    A call cancelled while queued is withdrawn and never runs. A call already
    being written waits for its transaction to finish (milliseconds; at most
    ``busy_timeout`` more while another process holds the write lock) and then
    raises ``Cancelled``: its write happened completely or not at all, and
    nothing of it is left running. On a disk that stops answering (a frozen
    file system, a hung network volume: the transaction blocks in the kernel)
    it waits ``busy_timeout`` and 5 seconds more, then raises ``Cancelled``
    all the same: whether that write lands is then unknown (as after any
    store's timeout), and the connection's thread finishes it, or not, on its
    own. So a registry's close over such a disk ends within its bounds (see
    the shutdown how-to) rather than when the disk comes back. :meth:`statistics`
    shows how well appends are grouped.
    """

    path: str = attrs.field(converter=_fspath)
    synchronous: str = attrs.field(
        default="FULL", kw_only=True, converter=_upper, validator=_check_synchronous
    )
    busy_timeout: float = attrs.field(
        default=5.0, kw_only=True, converter=float, validator=_check_busy_timeout
    )
    shared: bool = attrs.field(default=False, kw_only=True, validator=_check_flag)
    readonly: bool = attrs.field(default=False, kw_only=True, validator=_check_flag)
    _counters: _Counters = attrs.field(init=False, factory=_Counters, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    _worker: _Worker | None = attrs.field(init=False, default=None, repr=False)
    _finalizer: weakref.finalize[Any, Any] | None = attrs.field(
        init=False, default=None, repr=False
    )

    def __repr__(self) -> str:
        state = "open" if self._worker is not None else "closed"
        mode = ", shared" if self.shared else ", read-only" if self.readonly else ""
        return f"<SQLiteStore {self.path!r} ({state}{mode})>"

    @property
    def shared_by_workers(self) -> bool:
        """Whether several processes may write the file (``shared=True``): the
        registry then claims a lease for every session it runs."""
        return self.shared

    @property
    def writes_to(self) -> str | None:
        """The file this store writes, resolved (None if ``readonly``): a registry
        without leases refuses to open on it while another registry of this process
        writes it, through this store object or another."""
        return None if self.readonly else os.path.realpath(self.path)

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
        worker = self._worker
        if worker is not None and worker.submit(request):
            return worker
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
        request = self._request(session_id, op, writes=writes, args=args)
        return await trio.lowlevel.wait_task_rescheduled(request)

    def _request(
        self, session_id: str | None, op: _Op, *, writes: bool, args: tuple[Any, ...]
    ) -> _Request:
        """The calling task's request, queued for the connection's thread: to wait on."""
        if writes and self.readonly:
            about = f"session {session_id!r}: " if session_id is not None else ""
            raise StoreError(
                f"{about}the sqlite store at {self.path!r} is read-only (readonly=True);"
                " nothing was written. Open it without readonly=True to write",
                session_id=session_id,
            )
        request = _Request(op, session_id=session_id, writes=writes, args=args)
        request.worker = self._submit(request)
        return request

    async def aclose(self) -> None:
        """Finish every queued request, close the connection and stop its thread.

        Idempotent. The store opens again if it is used afterwards. Cancelled
        while the thread is still at work (a bound on the close, over a stalled
        disk), it raises ``Cancelled`` at once: the thread still finishes the
        queued requests (their callers are answered after their commit, as
        always), closes the file and releases its lock on its own. Until it has,
        another process is refused the file as in use; a store of this process
        that opens it meanwhile (this one used again, or a new one) is not, and
        waits for that thread before it reads or writes, up to ``busy_timeout``
        seconds, so that writes land in the order they were made (and then, if the
        file is still locked, up to ``busy_timeout`` again, as for any lock held).
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
            # The thread stops whatever happens, without this task: its answer to the
            # stop request is dropped (_deliver runs on this thread, as this does).
            stop.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        worker.join()  # it has answered: only its return is left

    # The Store protocol ------------------------------------------------------------

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        snapshot, info = bytes(snapshot), bytes(info)
        activity = info_activity(info)

        def op(conn: sqlite3.Connection, now: float) -> None:
            inserted = conn.execute(
                "INSERT INTO sessions (session_id, snapshot_seq, last_seq, "
                "trimmed_upto, info, activity) VALUES (?, 0, 0, 0, ?, ?) "
                "ON CONFLICT (session_id) DO NOTHING",
                (session_id, info, activity),
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
                "SELECT snapshots.data, sessions.snapshot_seq, sessions.info FROM sessions "
                "JOIN snapshots USING (session_id) WHERE session_id = ?",
                (session_id,),
            ).fetchone()
            if row is None:
                return None
            snapshot, snapshot_seq, info = row
            snapshot_seq = _check_stored_seq(session_id, snapshot_seq, "the snapshot's seq")
            if snapshot.__class__ is not bytes:
                raise _stored_corrupt(session_id, "the snapshot is not bytes")
            rows = conn.execute(
                "SELECT seq, data FROM journal WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, snapshot_seq),
            ).fetchall()
            return StoredSession(
                snapshot=snapshot,
                snapshot_seq=snapshot_seq,
                entries=tuple(_check_stored_entries(session_id, rows, snapshot_seq)),
                # (damaged, not bytes: listed as failed, and read here as not given)
                info=info if info.__class__ is bytes else None,
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
        # ``_call`` without its frame: a turn waits here for its commit, with every
        # frame between, and a thousand turns waiting at once keep that many frames
        # more for the garbage collector to visit (benchmark 6)
        await trio.lowlevel.checkpoint_if_cancelled()
        for entry in entries:
            if entry.data.__class__ is not bytes:
                # bytes of its own (TypeError if it is not bytes-like): nothing the caller
                # changes later, nothing a shared transaction could fail on
                entries = [JournalEntry(e.seq, bytes(e.data)) for e in entries]
                break
        info = bytes(info)
        # Checked before the transaction: the seqs strictly increase among themselves.
        last_seq = _check_entries(session_id, entries, entries[0].seq - 1) if entries else None
        args = _AppendArgs(session_id, entries, info, fence, last_seq, info_activity(info))
        request = self._request(session_id, _append, writes=True, args=args)
        await trio.lowlevel.wait_task_rescheduled(request)

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
        activity = info_activity(info)

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
                "trimmed_upto = ?, info = ?, activity = ? WHERE session_id = ?",
                (seq, max(last_seq, seq), trimmed_upto, info, activity, session_id),
            )
            conn.execute(
                "UPDATE snapshots SET data = ? WHERE session_id = ?", (snapshot, session_id)
            )

        await self._call(session_id, op, writes=True)

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        since = min(max(after, 0), MAX_SEQ)  # every stored seq is in this range

        def op(conn: sqlite3.Connection, now: float) -> tuple[int, list[JournalEntry]]:
            trimmed = _trimmed_upto(conn, session_id)
            rows = conn.execute(
                "SELECT seq, data FROM journal WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, since),
            ).fetchall()
            return trimmed, _check_stored_entries(session_id, rows, since)

        result: tuple[int, list[JournalEntry]] = await self._call(session_id, op, writes=False)
        return result

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        since = min(max(after, 0), MAX_SEQ)

        def op(conn: sqlite3.Connection, now: float) -> tuple[int, list[JournalEntry]]:
            trimmed = _trimmed_upto(conn, session_id)
            cursor = conn.execute(
                "SELECT seq, data FROM journal WHERE session_id = ? AND seq > ? "
                "ORDER BY seq LIMIT ?",
                (session_id, since, max(limit, 1)),
            )
            rows = []
            total = 0
            for seq, data in cursor:  # rows are fetched one at a time: stop at the bound
                rows.append((seq, data))
                total += len(data) if isinstance(data, bytes) else 0
                if total >= max_bytes:
                    break
            cursor.close()
            return trimmed, _check_stored_entries(session_id, rows, since)

        result: tuple[int, list[JournalEntry]] = await self._call(session_id, op, writes=False)
        return result

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        def op(conn: sqlite3.Connection, now: float) -> list[tuple[str, bytes]]:
            rows = conn.execute(f"SELECT {_NAME}, info FROM sessions ORDER BY session_id")
            return _named(rows)

        result: list[tuple[str, bytes]] = await self._call(None, op, writes=False)
        return result

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        return await self._page(None, after, limit)

    async def list_idle_page(
        self, *, active_before: int, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        return await self._page(active_before, after, limit)

    async def _page(
        self, active_before: int | None, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        """A page of the listing, of the sessions active before ``active_before`` (if
        given), on the index of ``(activity, session_id)``."""

        def op(conn: sqlite3.Connection, now: float) -> list[tuple[str, bytes]]:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version < 2:  # an unmigrated file opened read-only: no index to page on
                rows = conn.execute(f"SELECT {_NAME}, info FROM sessions")
                return page_of(_named(rows), after=after, limit=limit, active_before=active_before)
            bound: tuple[int, bytes] | None = None
            if after is not None:
                key = _key(after)  # (the last of a page may be a damaged name)
                row = conn.execute(
                    f"SELECT activity FROM sessions WHERE session_id = {_BOUND}", (key,)
                ).fetchone()
                if row is None:
                    raise after_not_found(after)
                bound = (row[0], key)
            order = "ORDER BY activity DESC, session_id DESC LIMIT ?"
            if bound is not None and (active_before is None or bound[0] < active_before):
                rows = conn.execute(
                    f"SELECT {_NAME}, info FROM sessions "
                    f"WHERE (activity, session_id) < (?, {_BOUND}) {order}",
                    (*bound, limit),
                )
            elif active_before is not None:  # (past `after` too, if it was active since)
                rows = conn.execute(
                    f"SELECT {_NAME}, info FROM sessions WHERE activity < ? {order}",
                    (active_before, limit),
                )
            else:
                rows = conn.execute(f"SELECT {_NAME}, info FROM sessions {order}", (limit,))
            return _named(rows)

        result: list[tuple[str, bytes]] = await self._call(after, op, writes=False)
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
        """Remove the session everywhere (snapshot, journal, lease); whether it existed.
        Nothing of it is left in the file or its ``-wal`` when it returns (see the
        class: while a reader in another process holds an older snapshot, the ``-wal``
        is emptied once it is done)."""
        result: bool = await self._call(session_id, _delete, writes=True, args=(session_id,))
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
