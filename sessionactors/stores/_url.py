"""A store from a URL, as the command line takes it (``--store``)."""

from __future__ import annotations

import os
import urllib.parse
from typing import TYPE_CHECKING, Any, TypeGuard

from .._names import redact

if TYPE_CHECKING:
    from ._sqlite import SQLiteStore

__all__ = ["is_new_file", "open_store"]


def open_store(url: str, *, readonly: bool = False) -> Any:
    """A store from a URL: ``sqlite:///relative.db``, ``sqlite:////absolute.db``
    (``?shared=true``: several processes write the file, with leases),
    ``memory://``, or a ``RedisStore`` URL (extra ``redis``): ``redis://host:port/db``,
    ``rediss://``, ``unix://``, ``redis+cluster://host:port`` or
    ``redis+sentinel://host:port/service``, with ``?persistence=``, ``?replicas=``,
    ``?replica_timeout=`` and ``?prefix=`` (the key prefix) if needed.

    ``readonly`` is for a caller that only reads: it opens a SQLite file with
    ``readonly=True`` (no lock, no byte changed), and a Redis store with
    ``persistence="volatile"`` (whatever ``?persistence=`` the URL names), since
    reading loses nothing on a server that can lose writes (one without an
    append-only file): never write through it. A Redis
    store's listing still mends the store's index of sessions as it reads, as every
    listing does (it adds a session stored without a place in it, drops a name whose
    session is gone); no session's own keys are written.
    Raises ``ValueError`` for a URL that names no store (its message shows the URL
    with ``***`` in place of a password).
    """
    if url.startswith("sqlite://"):
        path, _, query = url.removeprefix("sqlite://").partition("?")
        if not path.startswith("/") or path == "/":
            raise ValueError(
                f"--store {redact(url)!r}: write sqlite:///relative.db or sqlite:////abs.db"
            )
        options = urllib.parse.parse_qs(query, keep_blank_values=True)
        shared = options.pop("shared", ["false"])[-1].lower()
        if options or shared not in ("true", "false", "1", "0"):
            raise ValueError(
                f"--store {redact(url)!r}: the only option of a sqlite URL is ?shared=true "
                "(several processes write the file, with leases)"
            )
        from ._sqlite import SQLiteStore

        if readonly:
            return SQLiteStore(path[1:], readonly=True)
        return SQLiteStore(path[1:], shared=shared in ("true", "1"))
    if url in ("memory://", "memory:"):
        from ._memory import MemoryStore

        return MemoryStore()
    schemes = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel")
    if url.startswith(tuple(f"{scheme}://" for scheme in schemes)):
        from ._redis import RedisStore

        if readonly:  # (the server's persistence guards writes; a reader makes none of its own)
            return RedisStore(_without_persistence(url), persistence="volatile")
        return RedisStore(url)
    raise ValueError(
        f"--store {redact(url)!r} is not a store URL; use sqlite:///path.db, memory:// or "
        "redis://..."
    )


def _without_persistence(url: str) -> str:
    """``url`` without its ``?persistence=`` option (the other options as they were)."""
    base, mark, query = url.partition("?")
    kept = [part for part in query.split("&") if part.partition("=")[0] != "persistence"]
    return f"{base}{mark}{'&'.join(kept)}" if any(kept) else base


def is_new_file(store: object) -> TypeGuard[SQLiteStore]:
    """Whether ``store`` is a SQLite store whose file is not there (yet): opening it for
    writing makes a new, empty one (a mistyped ``--store`` path, a file deleted while
    the server was stopped). A link to no file counts as none: SQLite makes its target."""
    from ._sqlite import SQLiteStore

    return isinstance(store, SQLiteStore) and not os.path.exists(store.path)
