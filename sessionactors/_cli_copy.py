"""``python -m sessionactors sessions copy --to URL [NAME ...]``: copy the sessions of a
store (every one, or those named) to another store, as ``export`` and ``import`` would
one by one: to move from SQLite to Redis when one process becomes many workers.

The source is read as the read commands read a store (opened read-only; each session
with ``read_session``, page by page of the listing ``list`` uses, so memory stays
bounded however many sessions it holds); each session is stored in the target as
``import`` stores it (same name, hibernated or as it was left, its pending reviews with it: see
``as_imported``), through the workers on a target that connects them. A session the
target already holds is skipped, one the source cannot read fails; both are said on
stderr and the copy goes on (status 1 for a failure, a copy in the target older than the
source's, or sessions of the source active while it was copied: a re-run after an
interruption skips what it copied and ends 0). SIGINT or SIGTERM stop it between two
sessions (a second one, at once).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import signal
import sys
import urllib.parse
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, Final

import attrs
import trio

from ._cli_sessions import (
    add_command,
    joined,
    not_a_url,
    open_given,
    say_if_empty,
    store_imported,
    told_line,
)
from ._errors import (
    InvalidSessionNameError,
    LeaseHeldError,
    SessionExistsError,
    SessionNotFoundError,
    SnapshotError,
)
from ._export import as_imported
from ._listing import LISTING_BATCH
from ._names import damaged_name, shell_quoted
from ._names import terminal_safe as _terminal_safe
from ._reading import list_stored, read_session, read_stored
from ._records import SessionInfo, SessionState
from ._registry import Registry
from ._router import RoutingStore
from ._session import LiveSession
from ._turns import turn_id_time
from .stores._base import Store
from .stores._sqlite import SQLiteStore
from .stores._url import GivenStore, is_new_file, open_store, read_store

__all__ = ["add_parser", "read_target"]

#: How many sessions one page of the source's listing holds.
PAGE: Final = LISTING_BATCH
#: The errors of reading one session of the source that fail that session only: it is
#: damaged (its bytes cannot be read), its name is one no session can have, or it was
#: deleted since it was listed. Any other error (the store's) ends the copy.
_UNREADABLE: Final = (SnapshotError, InvalidSessionNameError, SessionNotFoundError)
#: The options of a Redis URL that say how to reach or what to demand of a store, not
#: which store it is (two URLs that differ by them alone name the same one).
_NOT_PLACE: Final = frozenset(
    {"persistence", "replicas", "replica_timeout", "prefix", "password", "username"}
)


def add_parser(sub: Any) -> None:
    """Add ``copy`` to the ``sessions`` subcommands (``_cli_sessions.add_parser``'s)."""
    parser = add_command(
        sub,
        "copy",
        "copy every session of the store (or those named) to another store, as export and "
        "import would one by one; sessions the other store holds already are skipped",
        _copy,
    )
    parser.add_argument(
        "names",
        metavar="NAME",
        nargs="*",
        type=functools.partial(not_a_url, store_option="--to"),
        help="the sessions to copy (default: every one)",
    )
    parser.add_argument(
        "--to",
        default=None,
        metavar="URL",
        help="the store to copy to, as --store takes one (a password in it shows in the "
        "process list: prefer --to-file)",
    )
    parser.add_argument(
        "--to-file",
        default=None,
        metavar="PATH",
        help="read the URL of the store to copy to from this file (one line)",
    )


def read_target(args: argparse.Namespace) -> GivenStore | None:
    """The store that ``copy`` writes to, as ``--to`` or ``--to-file`` gives it (None for
    neither); ``ValueError`` as ``read_store`` raises it."""
    return read_store(args.to, args.to_file, option="--to", file_option="--to-file", variable=None)


@attrs.define
class _Tally:
    """How the copy goes: its counts, and what stops it (changed by its one task and
    the task that watches for signals, between checkpoints)."""

    copied: int = 0
    skipped: int = 0
    failed: int = 0
    #: Skipped sessions whose copy in the target is older than the source's (status 1).
    out_of_date: int = 0
    #: Sessions of the source active while it was copied (status 1).
    active: int = 0
    #: The session being copied (None between two).
    copying: str | None = None
    #: A signal asked to stop between two sessions (its number).
    stop: int | None = None
    #: The copy stopped, asked to, before the last session.
    cut: bool = False
    #: A second signal stopped it at once.
    forced: bool = False

    def line(self) -> str:
        return f"{self.copied} copied, {self.skipped} skipped, {self.failed} failed"


async def _copy(source: Store, args: argparse.Namespace) -> int:
    given: GivenStore = args.given_target
    try:
        opened = open_store(given.url, given=given)
    except ValueError as refused:  # not a store's URL: an argument, as for --store (2)
        _say(" ".join(str(refused).split()))
        return 2
    target = open_given(opened, given, write=True)
    if _same_store(source, target):
        raise ValueError(
            f"{args.given_store.shown()} and {given.shown()} are the same store, so "
            "nothing was copied; give --to another store (another file, database or "
            "?prefix=)"
        )
    created = target.path if is_new_file(target) else None
    tally = _Tally()
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        if tally.stop is None:
                            tally.stop = signum
                            if tally.copying is not None:
                                _say(
                                    f"stopping after session {tally.copying!r} "
                                    "(a second signal stops at once)"
                                )
                            continue
                        tally.forced = True
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                await _copy_all(source, target, args, tally)
                nursery.cancel_scope.cancel()
    finally:  # (whatever ended the copy: the counts so far)
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await target.aclose()
        _out(tally.line())
        if created is not None and os.path.exists(created):  # noqa: ASYNC240 (a stat)
            _say(
                f"created a new store at {created!r} (no file was there); if you meant a "
                f"store of yours, check the path in {given.where()}"
            )
    if tally.stop is not None and (tally.cut or tally.forced):
        if tally.forced and tally.copying is not None:
            _say(
                f"stopped at once while copying session {tally.copying!r}, which the store "
                "copied to may hold or not; run the copy again to copy the rest (the "
                "sessions copied are skipped)"
            )
        else:
            _say(
                "stopped before the end; run the copy again to copy the rest "
                "(the sessions copied are skipped)"
            )
        return 128 + tally.stop
    if tally.active:
        _say(
            f"{tally.active} session{'s' if tally.active > 1 else ''} of the source "
            f"{'were' if tally.active > 1 else 'was'} active while it was copied: the "
            "store copied to may lack some of them, or hold them as they were before; "
            "once no server writes the source, run the copy again"
        )
    return 1 if tally.failed or tally.out_of_date or tally.active else 0


async def _copy_all(source: Store, target: Store, args: argparse.Namespace, tally: _Tally) -> None:
    async with contextlib.AsyncExitStack() as stack:
        registry: Registry | None = None
        if isinstance(target, RoutingStore):  # stored as import stores it, by the workers
            registry = await stack.enter_async_context(joined(target))
        listed = False
        # (the newest activity the source holds, by the clocks of what wrote it)
        newest = None if args.names else await _newest_activity(source)
        async with aclosing(_names(source, args, tally)) as names:
            async for name in names:
                listed = True
                if tally.stop is not None:
                    tally.cut = True
                    return
                tally.copying = name
                await _copy_one(source, target, registry, name, args, tally)
                tally.copying = None
        if not listed and not args.names:
            await say_if_empty(source, args.given_store, "copy")
        if not args.names:  # (whole: did the source change under it?)
            tally.active = await _active_since(source, newest)


async def _newest_activity(source: Store) -> datetime.datetime | None:
    """The activity time of the session of ``source`` active last (None: it holds none)."""
    first = await list_stored(source, limit=1, damaged=_ignored)
    return first[0].updated_at if first else None


async def _active_since(source: Store, newest: datetime.datetime | None) -> int:
    """How many sessions of ``source`` were active after ``newest`` (every one, if None),
    read from the listing's first pages (newest activity first)."""
    count = 0
    async with aclosing(_listing(source, _ignored)) as listing:
        async for info in listing:
            if newest is not None and info.updated_at <= newest:
                break
            count += 1
    return count


def _ignored(raw: bytes) -> None:
    """(A damaged name, said once already by the copy's own listing.)"""


async def _names(
    source: Store, args: argparse.Namespace, tally: _Tally
) -> AsyncGenerator[str, None]:
    """The names to copy: those given, or every session of ``source``, read page by page
    (after the last name of the page before, as ``list --after`` pages)."""
    if args.names:
        for name in dict.fromkeys(args.names):
            yield name
        return

    def damaged(raw: bytes) -> None:
        tally.failed += 1
        _say(
            f"a stored session's name is not UTF-8 (damaged data): {shell_quoted(raw)}; "
            "not copied (no request can reach a session under it)"
        )

    async with aclosing(_listing(source, damaged)) as listing:
        async for info in listing:
            yield info.session_id


async def _listing(
    source: Store, damaged: Callable[[bytes], None]
) -> AsyncGenerator[SessionInfo, None]:
    """Every session of ``source`` in listing order (newest activity first), read page by
    page (after the last name of the page before, as ``list --after`` pages)."""
    after: str | None = None
    while True:
        page = await list_stored(source, limit=PAGE, after=after, damaged=damaged)
        for info in page:
            yield info
        if len(page) < PAGE:
            return
        after = page[-1].session_id


async def _copy_one(
    source: Store,
    target: Store,
    registry: Registry | None,
    name: str,
    args: argparse.Namespace,
    tally: _Tally,
) -> None:
    """Copy ``name``, counted in ``tally``: a line on stdout if it was copied, on stderr
    if not."""
    try:
        if damaged_name(name) is not None:  # (given as list shows a damaged name)
            raise InvalidSessionNameError(
                f"session {_shown(name)} has a damaged name (not UTF-8), which no "
                "request can reach",
                session_id=None,
            )
        state = as_imported(await read_session(source, name))
    except _UNREADABLE as exc:
        tally.failed += 1
        _say(f"not copied: {told_line(args, exc)}")
        return
    try:
        await store_imported(target, registry, state, "copied")
    except (SnapshotError, ValueError) as exc:  # (too large to write as one snapshot, its
        # history past the limit a session keeps in its journal: nothing written)
        tally.failed += 1
        _say(f"not copied: {told_line(args, exc)}")
        return
    except SessionExistsError:
        tally.skipped += 1
        _say(await _already_there(target, state, tally))
        return
    except LeaseHeldError:  # (live in a process that shares the target's file)
        tally.skipped += 1
        _say(
            f"session {name!r} is live in a process that uses the store copied to, so it "
            "is in that store already; skipped"
        )
        return
    tally.copied += 1
    _out(f"copied session {name!r} ({len(state.messages)} messages)")


async def _already_there(target: Store, state: SessionState, tally: _Tally) -> str:
    """What to say of session ``state`` (the source's), skipped because ``target`` holds
    its name: another session under it, an earlier copy of it (the source's is newer:
    counted in ``tally``), or the copy as it is."""
    name = state.session_id
    try:
        there, _ = await read_stored(target, name, history=False)
    except _UNREADABLE:
        return (
            f"session {name!r} is in the store copied to, which cannot read it (damaged, "
            "or deleted meanwhile); skipped (delete it there first to copy it again)"
        )
    if there.created_at != state.created_at:
        return (
            f"session {name!r} in the store copied to is another session (created "
            f"{_when(there.created_at)}; the source's, {_when(state.created_at)}); skipped "
            "(to copy this one, delete that one there first, or import an export of it "
            "under another name with import --as)"
        )
    course = _course(state, there)
    if course == "apart":
        tally.out_of_date += 1
        return (
            f"session {name!r} in the store copied to has gone on apart from the source: "
            "each took turns since the copy that the other does not hold; skipped, so the "
            "source's turns since are in the source only (to keep them too, export it from "
            "the source and import it under another name with import --as)"
        )
    if course == "behind" or state.updated_at > there.updated_at:
        tally.out_of_date += 1
        return (
            f"session {name!r} in the store copied to is an earlier copy of it, older than "
            f"the source's (last active {_when(there.updated_at)}; the source's, "
            f"{_when(state.updated_at)}): skipped, so the turns since are in the source "
            "only; once no server writes the source, delete it there and copy it again"
        )
    return (
        f"session {name!r} is already in the store copied to; skipped (delete it there "
        "first to copy it again)"
    )


def _course(source: SessionState, there: LiveSession) -> str:
    """How the target's copy ``there`` stands to the source's session, told by their
    turns' ids (no clock): "behind" (the source took turns since), "apart" (both did),
    or "" when their turns do not tell (a session without turns, the same last turn,
    only the copy took turns since, or one forgot the turn it would be told by): then
    their last activity tells (the source's edits since, which no turn id shows)."""
    mine = {record.turn_id for record in source.turns}
    theirs = there.turns  # (by turn id, oldest first)
    if not mine or not theirs:
        return ""
    my_last, their_last = source.turns[-1].turn_id, next(reversed(theirs))
    if my_last == their_last:
        return ""
    if their_last in mine:
        return "behind"
    if my_last in theirs:
        return ""
    forgotten = (turn_id_time(my_last) or 0) <= there.turns_forgotten or (
        turn_id_time(their_last) or 0
    ) <= source.turns_forgotten
    return "" if forgotten else "apart"


def _when(at: datetime.datetime) -> str:
    return at.isoformat(sep=" ", timespec="milliseconds")


def _same_store(a: Store, b: Store) -> bool:
    """Whether ``a`` and ``b`` are the same store: the same SQLite file (however its
    path is written), or Redis URLs that name the same server (or cluster, or
    Sentinel service), database and key prefix."""
    if isinstance(a, SQLiteStore) and isinstance(b, SQLiteStore):
        try:
            return os.path.samefile(a.path, b.path)
        except OSError:  # (one is not there yet)
            return os.path.realpath(a.path) == os.path.realpath(b.path)
    place_a, place_b = _redis_place(a), _redis_place(b)
    return place_a is not None and place_a == place_b


def _redis_place(store: Store) -> tuple[object, ...] | None:
    """Which Redis store ``store`` is: its URL's scheme, hosts and path (database,
    socket or service) and the other options that pick the server, without the user,
    the password and the options that do not (see ``_NOT_PLACE``), and its key prefix;
    None for a store that is not a Redis store of a URL."""
    url, prefix = getattr(store, "url", None), getattr(store, "prefix", None)
    if not isinstance(url, str) or not isinstance(prefix, str) or "://" not in url:
        return None
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    kind = next((k for k in ("cluster", "sentinel", "unix") if k in scheme), "server")
    port = "26379" if kind == "sentinel" else "6379"  # (the defaults)
    hosts = sorted(
        item if item.rpartition(":")[2].isdigit() else f"{item}:{port}"
        for item in parts.netloc.rpartition("@")[2].lower().split(",")
    )
    query = {
        key: value
        for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if key not in _NOT_PLACE
    }
    path = parts.path
    if kind == "server":  # (TLS or not: the same server)
        path = query.pop("db", "") or path.strip("/") or "0"
        path = str(int(path)) if path.isdigit() else path
    elif kind == "cluster":  # (one database)
        path = ""
    return (kind, hosts, path, sorted(query.items()), prefix)


def _shown(name: str) -> str:
    raw = damaged_name(name)
    return repr(name) if raw is None else shell_quoted(raw)


def _say(text: str) -> None:
    print(f"sessionactors sessions copy: {_terminal_safe(text)}", file=sys.stderr, flush=True)


def _out(text: str) -> None:
    """A line on stdout, at once (a copy of many sessions shows its progress)."""
    sys.stdout.write(_terminal_safe(text) + "\n")
    sys.stdout.flush()
