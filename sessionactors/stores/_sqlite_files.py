"""The files of an ``SQLiteStore`` on disk, apart from what SQLite does with them: the
lock between processes (an advisory ``flock`` on ``<path>.lock``, shared by the stores
of one process), and the checks of the file, its ``-wal`` and ``-shm`` made before the
store opens them (a file this process may not write, a ``-wal`` left without its file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from typing import Final

import attrs

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock between processes
    fcntl = None  # type: ignore[assignment]


class _OpenError(Exception):
    """The file cannot be opened as this store; the message says why and what to do."""


class _RefusedError(_OpenError):
    """No retry opens the file until someone changes it, its permissions or the store's
    path: the path is a directory or in one that is not there, the file is not a store
    or is of a newer schema version, this process may not write it, a ``-wal`` is left
    without its file (the store's ``StoreConfigurationError``)."""


def _check_path(path: str) -> None:
    """Refuse a path that no retry opens: a directory, or one whose directory does not
    exist (or is a file): a mistyped path, which is not made for the store; one that
    holds a NUL character, or a loop of symbolic links."""
    if "\x00" in path:
        raise _RefusedError(
            f"the sqlite store at {path!r} cannot be opened: the path holds a NUL "
            "character, which no file's path can hold; correct the store's path"
        )
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _RefusedError(
                f"the sqlite store at {path!r} cannot be opened: its path is a loop of "
                "symbolic links; correct the link or the store's path"
            ) from None
    if os.path.isdir(path):
        raise _RefusedError(
            f"the sqlite store at {path!r} is a directory, not a SQLite file; pass the "
            "path of a store file (or of a file that does not exist yet: it is created)"
        )
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(directory):
        return
    if os.path.lexists(directory) or _under_a_file(directory):
        problem = "is not a directory: correct the store's path"
    else:
        problem = (
            "does not exist: create it, or correct the store's path (on the command line: in "
            "the store's URL)"
        )
    raise _RefusedError(
        f"the sqlite store at {path!r} cannot be opened: the directory {directory!r} {problem}"
    )


def _under_a_file(directory: str) -> bool:
    """Whether a parent of ``directory`` (which is not there) is a file."""
    parent = os.path.dirname(directory)
    while parent != directory:
        if os.path.lexists(parent):
            return not os.path.isdir(parent)
        directory, parent = parent, os.path.dirname(parent)
    return False


# The lock between processes ----------------------------------------------------


@attrs.define(eq=False)
class _Held:
    fd: int
    count: int
    path: str  # the lock file's
    shared: bool
    ident: tuple[int, int]  # the lock file's device and inode


# This process's locks, by the lock file's path: the stores of one process share
# one lock (flock locks belong to an open file, so a second open in the same
# process would conflict with the first).
_HELD: Final[dict[str, _Held]] = {}
_HELD_LOCK: Final = threading.Lock()


def _forget_locks_after_fork() -> None:
    # A forked child is another process: it takes locks of its own. Closing its
    # copies leaves the parent's locks in place.
    for held in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_after_fork)


def _acquire_lock(path: str, *, shared: bool) -> str | None:
    """Lock ``<path>.lock`` for this process (exclusive unless ``shared``); its key.

    An exclusive lock's file is removed when it is released (see
    :func:`_release_lock`), so the lock is taken on the file that is at the path
    at that moment: a file removed meanwhile is dropped, and the lock taken again.
    """
    if fcntl is None:  # pragma: no cover - not POSIX
        return None
    lock_path = os.path.abspath(f"{path}.lock")
    with _HELD_LOCK:
        held = _HELD.get(lock_path)
        if held is not None:
            held.count += 1
            return lock_path
        for _ in range(100):
            fd = _open_lock_file(path, lock_path)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                message = _in_use_message(path, lock_path, fd, shared=shared)
                os.close(fd)
                raise _OpenError(message) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                current = os.stat(lock_path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
            if current is None or (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)  # removed by its last holder meanwhile: lock the new one
                continue
            _note_holder(fd, shared=shared)
            ident = (mine.st_dev, mine.st_ino)
            _HELD[lock_path] = _Held(fd=fd, count=1, path=lock_path, shared=shared, ident=ident)
            return lock_path
    raise _OpenError(  # pragma: no cover - another process removing it 100 times in a row
        f"the sqlite store at {path!r} cannot take its lock {lock_path!r}: it keeps being"
        " removed; retry"
    )


def _check_lock(path: str, key: str | None) -> None:
    """Take the lock ``key`` again if its file was deleted or replaced while this process
    held it (a clean-up of stale lock files, say): a process that opens the store then
    is refused as it would have been. Raise ``_OpenError`` if another process took the
    new file's lock first: it uses the store now, and this one must not write."""
    if key is None or fcntl is None:
        return
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is None:
            return
        try:
            st = os.stat(key)
        except FileNotFoundError:
            pass
        else:
            if (st.st_dev, st.st_ino) == held.ident:
                return
        fd = _open_lock_file(path, key)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if held.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            message = _in_use_message(path, key, fd, shared=held.shared)
            os.close(fd)
            raise _OpenError(
                f"{message}. This process held the lock until its file was deleted, and"
                " that process took the new one: this process writes nothing more to the"
                " file (nothing was written now); stop one of them"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        mine = os.fstat(fd)
        _note_holder(fd, shared=held.shared)
        os.close(held.fd)
        held.fd, held.ident = fd, (mine.st_dev, mine.st_ino)


def _note_holder(fd: int, *, shared: bool) -> None:
    """Write this process's id into the lock file it locked, for the message that a
    second process gets. Only a note: on a full disk the lock holds without it (and a
    failure here must not leave the lock held by nobody's record of it)."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {'shared' if shared else 'exclusive'}\n".encode(), 0)


def _open_lock_file(path: str, lock_path: str) -> int:
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            name = lock_path if os.path.exists(lock_path) else os.path.dirname(lock_path)
            raise _RefusedError(_read_only(path, name)) from exc
        raise _OpenError(
            f"the sqlite store at {path!r} cannot open its lock file {lock_path!r} ({exc});"
            " check that its directory exists and can be written"
        ) from exc


def _in_use_message(path: str, lock_path: str, fd: int, *, shared: bool) -> str:
    try:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").split()
    except OSError:
        holder = []
    who = f"process {holder[0]} ({holder[1]})" if len(holder) == 2 else "another process"
    if shared:
        return (
            f"the sqlite store at {path!r} is in use by {who}, which opened it unshared;"
            " to share a file between processes, open it with SQLiteStore(path,"
            " shared=True) in every one of them (leases then keep each session in one"
            f" process), or stop that process. The lock is {lock_path!r}"
        )
    return (
        f"the sqlite store at {path!r} is in use by {who}; two processes writing one"
        " file without leases would both change the same sessions. Run one process per"
        " file (a server of several worker processes, such as uvicorn --workers, runs on"
        " a RedisStore with sessionactors.workers: see the many-workers how-to); a few"
        " processes behind routing that sends each session's requests to one of them"
        " open the store with SQLiteStore(path, shared=True) in every one (leases keep"
        " each session in one process: another refuses it with LeaseHeldError); to look"
        f" at it while it is in use, open it with readonly=True. The lock is {lock_path!r}"
    )


def _file_stamp(path: str) -> tuple[int, ...] | None:
    """What changes when a file is written or replaced: inode, size, times (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _release_lock(key: str | None) -> None:
    """This process no longer needs the lock ``key`` (when its last store closes, the
    lock is released; an exclusive lock's file is removed first, while still held,
    so that nothing of the store stays beside the database)."""
    if key is None:
        return
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is None:
            return
        held.count -= 1
        if held.count == 0:
            del _HELD[key]
            if not held.shared:
                with contextlib.suppress(OSError):
                    st = os.stat(held.path)
                    if (st.st_dev, st.st_ino) == held.ident:  # (not another process's)
                        os.unlink(held.path)
            os.close(held.fd)  # releases the flock


def _check_no_orphan_wal(path: str) -> None:
    """Refuse to make a store at ``path`` beside a ``-wal`` that holds writes: it was left
    by a file deleted or moved away, and SQLite would read it into the new file."""
    wal = f"{path}-wal"
    try:
        size = os.path.getsize(wal)
    except OSError:
        return
    if size > 0:
        raise _RefusedError(
            f"the sqlite store at {path!r} does not exist, but {wal!r} ({size} bytes) does:"
            " the write-ahead log of a store file that was deleted or moved away, which"
            " SQLite would read into a new file. Put that file back at the path (the -wal"
            f" holds its last writes), or delete {wal!r} and {path + '-shm'!r} to start a"
            " new store there"
        )


def _check_writable(path: str) -> None:
    """Refuse a file (or its ``-wal`` or ``-shm``, or the directory that they are made
    in) that this process may not write: SQLite would open it read-only, fail every
    write, and leave a read-only ``-wal`` and ``-shm`` behind.

    Asked with ``access``, never by opening the files: closing a descriptor of a file
    drops every POSIX lock this process holds on it, those of SQLite's connections of
    other stores of this process included.
    """
    missing = False
    for name in (path, f"{path}-wal", f"{path}-shm"):
        if not os.path.exists(name):
            missing = True
        elif not os.access(name, os.R_OK | os.W_OK):
            raise _RefusedError(_read_only(path, name))
    directory = os.path.dirname(os.path.abspath(path))
    if missing and not os.access(directory, os.W_OK | os.X_OK):
        raise _RefusedError(_read_only(path, directory))


def _read_only(path: str, name: str) -> str:
    if os.path.exists(path):
        instead = "or open the store with readonly=True to read it"
    else:
        instead = "or pass a path in a directory that it may write"
    return (
        f"the sqlite store at {path!r} is read-only for this process: {name!r} cannot be"
        " written (its permissions, or a read-only file system); nothing was written."
        f" Make it writable for this process's user, {instead}"
    )
