"""A store from a URL, as the command line takes it: ``--store URL``, ``--store-file
PATH`` (the URL in a file) or the ``SESSIONACTORS_STORE`` environment variable."""

from __future__ import annotations

import os
import shlex
import urllib.parse
from typing import TYPE_CHECKING, Any, Final, TypeGuard

import attrs

from .._names import redact

if TYPE_CHECKING:
    from ._sqlite import SQLiteStore

__all__ = ["STORE_VARIABLE", "GivenStore", "is_new_file", "open_store", "read_store"]

#: The environment variable that holds the store's URL when neither ``--store`` nor
#: ``--store-file`` gives one.
STORE_VARIABLE: Final = "SESSIONACTORS_STORE"

#: The most characters a ``--store-file`` is read for: far more than any store's URL
#: (a device that never ends, /dev/zero, or a large file given by mistake is refused).
MAX_STORE_FILE: Final = 64 * 1024


@attrs.frozen(kw_only=True)
class GivenStore:
    """A store's URL as the command line was given it."""

    url: str
    #: Where it came from: ``"--store"``, ``"--store-file"`` or ``STORE_VARIABLE``.
    source: str
    #: The file's path, for ``--store-file``.
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
        return self.source if self.path is None else f"--store-file {self.path!r}"

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


def read_store(store: str | None, store_file: str | None) -> GivenStore | None:
    """The store's URL that ``--store``, ``--store-file`` or the environment gives (in that
    order: an option given wins over ``SESSIONACTORS_STORE``), or None for none of them;
    a file's or the variable's surrounding whitespace is dropped. Raises ``ValueError``
    for both options given, and for a file that cannot be read, is empty or holds more
    than one line (and the variable so): its message names the file or the variable,
    never what it holds."""
    if store is not None and store_file is not None:
        raise ValueError("give --store or --store-file, not both")
    if store is not None:
        return GivenStore(url=store, source="--store")
    if store_file is not None:
        try:
            with open(store_file, encoding="utf-8") as file:
                text = file.read(MAX_STORE_FILE + 1)
        except (OSError, UnicodeDecodeError) as exc:
            reason = (
                exc.strerror or type(exc).__name__
                if isinstance(exc, OSError)
                else "it is not UTF-8 text"
            )
            raise ValueError(f"--store-file {store_file!r}: cannot read it ({reason})") from None
        where = f"--store-file {store_file!r}"
        url = _one_line(text, where, f"{where} is empty; put the store's URL in it")
        if len(text) > MAX_STORE_FILE:
            raise ValueError(
                f"--store-file {store_file!r} holds over {MAX_STORE_FILE:,} characters, more "
                "than a store's URL; put the store's URL alone in it"
            )
        return GivenStore(url=url, source="--store-file", path=store_file)
    variable = os.environ.get(STORE_VARIABLE)
    if variable is None:
        return None
    # (its surrounding whitespace dropped, as a store file's is: `export X="$(cat f)"`)
    empty = f"{STORE_VARIABLE} is set but empty; give it a store's URL, or unset it"
    url = _one_line(variable, STORE_VARIABLE, empty)
    return GivenStore(url=url, source=STORE_VARIABLE)


def _one_line(text: str, where: str, empty: str) -> str:
    """``text`` without its surrounding whitespace, refused with ``empty`` if that leaves
    nothing, and if it holds more than one line (``where`` names it; what it holds is
    never shown: a password)."""
    url = text.strip()
    if not url:
        raise ValueError(empty)
    if len(url.splitlines()) > 1:
        raise ValueError(
            f"{where} holds more than one line; give the store's URL alone, on one line"
        )
    return url


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
