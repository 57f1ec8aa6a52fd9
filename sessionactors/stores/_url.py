"""A store from a URL, as the command line takes it: ``--store URL``, ``--store-file
PATH`` (the URL in a file) or the ``SESSIONACTORS_STORE`` environment variable."""

from __future__ import annotations

import os
import shlex
import urllib.parse
from typing import TYPE_CHECKING, Any, Final, TypeGuard

import attrs

from .._cli_given import read_given
from .._names import redact

if TYPE_CHECKING:
    from ._sqlite import SQLiteStore

__all__ = ["STORE_VARIABLE", "GivenStore", "is_new_file", "open_store", "read_store"]

#: The environment variable that holds the store's URL when neither ``--store`` nor
#: ``--store-file`` gives one.
STORE_VARIABLE: Final = "SESSIONACTORS_STORE"


@attrs.frozen(kw_only=True)
class GivenStore:
    """A store's URL as the command line was given it."""

    url: str
    #: Where it came from: ``"--store"``, ``"--store-file"`` or ``STORE_VARIABLE`` (for
    #: the store that ``sessions copy`` writes to, ``"--to"`` or ``"--to-file"``).
    source: str
    #: The file's path, for ``--store-file`` (``--to-file``).
    path: str | None = None

    def __repr__(self) -> str:  # (never the password, were it printed)
        return f"GivenStore({self.shown()})"

    def shown(self) -> str:
        """The URL as a message names it: where it came from, and the URL with ``***`` in
        place of its password (``--store-file '/etc/sa/store' holds 'redis://:***@h/0'``)."""
        if self.path is not None:
            return f"{self.where()} holds {redact(self.url)!r}"
        return f"{self.where()} {redact(self.url)!r}"

    def where(self) -> str:
        """Where the URL came from, as a message that shows the store otherwise names it
        (``check the path in --store-file '/etc/sa/store'``): ``--store``, ``--store-file``
        with the file's path, or ``SESSIONACTORS_STORE``."""
        return self.source if self.path is None else f"{self.source} {self.path!r}"

    def option(self) -> tuple[str, bool]:
        """The option (shell words) that gives this store to a command printed for the
        user to run, and whether a password in it was replaced by ``***`` (to put back):
        the same ``--store-file``, nothing for the environment variable (the command runs
        in the same environment), and ``--store`` with the URL redacted."""
        if self.path is not None:
            return f"--store-file {shlex.quote(self.path)}", False
        if self.source == STORE_VARIABLE:
            return "", False
        shown = redact(self.url)
        return f"--store {shlex.quote(shown)}", shown != self.url


def read_store(
    store: str | None,
    store_file: str | None,
    *,
    option: str = "--store",
    file_option: str = "--store-file",
    variable: str | None = STORE_VARIABLE,
) -> GivenStore | None:
    """The store's URL that ``--store``, ``--store-file`` or the environment gives (in that
    order: an option given wins over ``SESSIONACTORS_STORE``), or None for none of them;
    a file's or the variable's surrounding whitespace is dropped. Raises ``ValueError``
    for both options given, and for a file that cannot be read, is empty, holds more
    than one line or is far larger than a URL (and the variable so): its message names
    the file or the variable, never what it holds. ``option``, ``file_option`` and
    ``variable`` name another pair of options (``--to``, ``--to-file``) and variable
    (None: none)."""
    given = read_given(
        store,
        store_file,
        option=option,
        file_option=file_option,
        variable=variable,
        what=("the store's URL", "a store's URL"),
    )
    if given is None:
        return None
    url, source = given
    return GivenStore(url=url, source=source, path=store_file if source == file_option else None)


def open_store(url: str, *, readonly: bool = False, given: GivenStore | None = None) -> Any:
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
    with ``***`` in place of a password, and where ``given`` says it came from).
    """
    shown = f"--store {redact(url)!r}" if given is None else given.shown()
    if url.startswith("sqlite://"):
        path, _, query = url.removeprefix("sqlite://").partition("?")
        if not path.startswith("/") or path == "/":
            raise ValueError(f"{shown}: write sqlite:///relative.db or sqlite:////abs.db")
        options = urllib.parse.parse_qs(query, keep_blank_values=True)
        shared = options.pop("shared", ["false"])[-1].lower()
        if options or shared not in ("true", "false", "1", "0"):
            raise ValueError(
                f"{shown}: the only option of a sqlite URL is ?shared=true "
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
    raise ValueError(f"{shown}: not a store URL; use sqlite:///path.db, memory:// or redis://...")


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
