"""``python -m sessionactors sessions ...``: list, show, export, import, delete and tail
the sessions of a store (``copy``, which copies them to another store, is in ``_cli_copy``).

Read commands (``list``, ``show``, ``export``, ``tail``) open the store for
reading only (a SQLite file with ``readonly=True``; a Redis store demanding no
persistence of its server, since a reader loses nothing) and read sessions with
``read_session``: they wake, write, lease and lock nothing and need no agent, so
they run beside a server using the same store and leave its files unchanged.
Write commands (``import``, ``delete``) on a store that connects workers (Redis)
join them as an agentless registry, so a delete is done by the worker that runs
the session or holds its shard; on a SQLite file that several processes share
they take the session's lease, and are refused while another process holds it.
Errors are one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import os
import re
import shlex
import signal
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, Final, TextIO

import trio

from ._codec import dump_info, dump_snapshot
from ._errors import (
    Advice,
    AdviceKind,
    FencedOutError,
    InvalidSessionNameError,
    LeaseHeldError,
    SessionActorsError,
    SessionExistsError,
    SessionNotFoundError,
    StoreConfigurationError,
    StoreError,
    StoreNotDurableError,
    python_advice,
    told,
)
from ._export import dump_export, load_export
from ._journal import store_new
from ._json import event_to_json, json_text, metadata_json, state_to_json, to_json
from ._names import (
    damaged_name,
    delete_command,
    is_url,
    redact,
    shell_quoted,
    validate_name,
)
from ._names import terminal_safe as _terminal_safe
from ._reading import list_stored, read_events, read_session
from ._records import (
    Role,
    SessionInfo,
    SessionState,
    Status,
    TurnRecord,
    TurnStatus,
    new_id,
    utcnow,
)
from ._registry import Registry, create_session, open_registry
from ._router import RoutingStore
from ._session import LiveSession
from .stores._base import PagedStore, Store
from .stores._memory import MemoryStore
from .stores._sqlite import SQLiteStore
from .stores._url import STORE_VARIABLE, GivenStore, is_new_file, open_store

__all__ = [
    "EXIT_PIPE_CLOSED",
    "add_command",
    "add_parser",
    "add_store_arguments",
    "joined",
    "leased",
    "not_a_url",
    "open_given",
    "quiet_stdout",
    "run",
    "say_if_empty",
    "store_imported",
    "told_line",
]

#: Seconds between two reads of the journal while ``tail`` follows a session.
TAIL_INTERVAL: Final = 0.5
#: The largest export ``import`` reads, in bytes: the largest snapshot (64 MiB) written
#: as JSON, where a control character takes six bytes, and again as base64, fits well.
MAX_IMPORT_BYTES: Final = 1024 * 1024 * 1024
#: How long ``tail`` retries a store that does not answer before it gives up, in seconds.
TAIL_OUTAGE: Final = 60.0
#: The store errors that retrying does not mend (a configuration to change).
_LASTING: Final = (StoreConfigurationError, StoreNotDurableError, FencedOutError)
#: The exit status when the reader of standard output closed it (as a shell reports a
#: process that SIGPIPE ended: 128 + 13).
EXIT_PIPE_CLOSED: Final = 141
#: How long a write command holds the session's lease on a shared SQLite file, in
#: seconds (it is released when the command ends; this bounds how long a killed
#: command blocks the session).
LEASE_TTL: Final = 30.0


def add_parser(commands: Any) -> Any:
    """Add ``sessions`` and its subcommands to the command line's subparsers; its own
    subparsers, for ``add_command``."""
    sessions = commands.add_parser(
        "sessions",
        help="list, show, export, import, delete, tail and copy the sessions of a store",
    )
    sub = sessions.add_subparsers(dest="sessions_command", required=True, metavar="COMMAND")
    command = functools.partial(add_command, sub)

    listing = command("list", "list sessions, newest activity first", _list)
    listing.add_argument("--status", choices=[s.value for s in Status])
    listing.add_argument(
        "--meta",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only sessions whose metadata has KEY equal to VALUE (VALUE as JSON if it parses: "
        "n=5 is a number, tenant=acme a string); repeat for more keys",
    )
    listing.add_argument("--limit", type=_positive, default=None, metavar="N")
    listing.add_argument("--after", metavar="NAME", help="start after this session (paging)")
    listing.add_argument(
        "--active-before",
        type=_active_before,
        default=None,
        metavar="WHEN",
        help="only sessions last active before WHEN: an ISO 8601 time with its offset "
        "(2025-01-31T00:00:00+00:00) or a duration before now (90d, 12h, 30m, 45s)",
    )
    listing.add_argument("--json", action="store_true", help="one JSON array")
    show = command("show", "a session's status, metadata, summary, reviews and messages", _show)
    show.add_argument("name", metavar="NAME")
    show.add_argument("--events", action="store_true", help="also its journaled events")
    show.add_argument("--json", action="store_true", help="one JSON object")
    export = command("export", "write a session as versioned JSON to standard output", _export)
    export.add_argument("name", metavar="NAME")
    imported = command("import", "store a session from an export (FILE, or - for stdin)", _import)
    imported.add_argument("file", metavar="FILE")
    imported.add_argument("--as", dest="rename", metavar="NAME", help="store it under NAME")
    delete = command("delete", "delete sessions from the store", _delete)
    delete.add_argument("names", metavar="NAME", nargs="+", type=not_a_url)
    delete.add_argument("--yes", action="store_true", help="yes, delete them")
    tail = command("tail", "print a session's events as JSON lines as they are stored", _tail)
    tail.add_argument("name", metavar="NAME")
    tail.add_argument(
        "--after",
        type=_seq,
        default=None,
        metavar="SEQ",
        help="begin with the stored events after SEQ (default: from now on; "
        "with --no-follow, every stored event)",
    )
    tail.add_argument("--no-follow", action="store_true", help="print the stored events and stop")
    tail.add_argument(
        "--wait",
        action="store_true",
        help="if the session is not stored yet, wait for it (saying so on stderr) and "
        "print its events from its first one, rather than fail; a session stored after "
        "tail started is printed from its first event too",
    )
    return sub


def add_command(
    sub: Any,
    name: str,
    help: str,
    run: Callable[[Store, argparse.Namespace], Awaitable[int]],
) -> argparse.ArgumentParser:
    """Add the ``sessions`` command ``name`` to ``sub`` (``add_parser``'s), with the store's
    options; ``run`` runs it, given the store opened (read-only for a command in
    ``_READS``)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    add_store_arguments(
        parser, "sqlite:///path.db (sqlite:////absolute.db) or redis://host:port/db"
    )
    parser.set_defaults(sessions_run=run)
    return parser


def add_store_arguments(parser: argparse.ArgumentParser, urls: str) -> None:
    """Add ``--store URL`` (``urls`` says which) and ``--store-file PATH`` to a command's
    parser; ``read_store`` reads them, or ``SESSIONACTORS_STORE`` without them."""
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help=f"{urls} (a password in it shows in the process list: prefer --store-file "
        f"or {STORE_VARIABLE})",
    )
    parser.add_argument(
        "--store-file",
        default=None,
        metavar="PATH",
        help="read the store's URL from this file (one line; a trailing newline is "
        f"dropped); without --store or --store-file, the store is {STORE_VARIABLE}",
    )


#: A store's URL (the schemes ``open_store`` takes), anywhere in a text.
_STORE_URL: Final = re.compile(
    r"(sqlite|memory|redis|rediss|unix|redis\+cluster|rediss\+cluster|redis\+sentinel):/",
    re.IGNORECASE,
)


def not_a_url(text: str, store_option: str = "--store") -> str:
    """A session's name to delete (or copy); one that holds a store's URL is refused: a
    URL given where a name goes (or an option with one that the parser took for a name:
    its value holds a space), whose password would be printed as the name's. The
    refusal says to give the store with ``store_option``."""
    if _STORE_URL.search(text):
        option, equals, value = text.partition("=")
        if is_url(text):
            shown = redact(text)
        elif text.startswith("-") and equals and is_url(value):  # (an option's, as --stor=)
            shown = f"{option}={redact(value)}"
        else:
            shown = "***"  # (anything else around it may be a secret too)
        raise argparse.ArgumentTypeError(
            f"a store's URL is no session's name ({shown}): give the store with {store_option} URL"
        )
    return text


def _positive(text: str) -> int:
    value = _seq(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


#: A duration before now, for ``list --active-before``: a whole number and its unit.
_DURATION: Final = re.compile(r"([0-9]{1,9})([dhms])")
_UNITS: Final = {"d": "days", "h": "hours", "m": "minutes", "s": "seconds"}


def _active_before(text: str) -> datetime:
    """``--active-before``'s WHEN: an ISO 8601 time with an offset, or a duration
    (``90d``, ``12h``, ``30m``, ``45s``) before now."""
    duration = _DURATION.fullmatch(text)
    if duration is not None:
        try:
            return datetime.now(UTC) - timedelta(**{_UNITS[duration[2]]: int(duration[1])})
        except OverflowError:
            raise argparse.ArgumentTypeError(f"{text!r} reaches before the year 1") from None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        when = None
    if when is None or when.utcoffset() is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an ISO 8601 time with an offset (2025-01-31T00:00:00+00:00, "
            "...Z) nor a duration before now (90d, 12h, 30m, 45s)"
        )
    return when


def _seq(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def run(args: argparse.Namespace) -> int:
    """Run one ``sessions`` command; its exit status (errors: one line on stderr)."""
    name = args.sessions_command
    command = args.sessions_run
    try:
        if name == "delete":
            _check_names(args.names)
            if not args.yes:
                raise ValueError(
                    f"this deletes {_sessions_named(args.names)} and all "
                    f"{'its' if len(args.names) == 1 else 'their'} history; "
                    "run it again with --yes to do it"
                )
        if sys.stdout is None:  # (started with it closed, as by `>&-`)
            raise OSError(
                "standard output is closed, so nothing was done; run it with "
                "standard output open (to /dev/null to discard it)"
            )
        given: GivenStore = args.given_store
        try:
            opened = open_store(given.url, readonly=name in _READS, given=given)
        except ValueError as refused:  # not a store's URL: an argument, as for serve (2)
            text = _terminal_safe(" ".join(str(refused).split()))
            print(f"sessionactors sessions {name}: {text}", file=sys.stderr)
            return 2
        store = open_given(opened, given, write=name not in _READS)
        if is_new_file(store) and name != "import" and not (name == "tail" and args.wait):
            missing = (
                f"the sqlite store at {store.path!r} does not exist; check the path in "
                f"{given.where()}"
            )
            if name == "delete":  # (a mistyped path: create no store there)
                names = args.names
                raise SessionNotFoundError(
                    f"{_sessions_named(names)} {'is' if len(names) == 1 else 'are'} not "
                    f"stored: {missing}",
                    session_id=names[0] if len(names) == 1 else None,
                )
            raise StoreError(missing)
        # (import makes the file: said, for a mistyped path; a tail --wait that waits
        # for a server to make it makes none)
        created = store.path if name == "import" and is_new_file(store) else None
        status = trio.run(_with_store, store, command, args)
        if created is not None and os.path.exists(created):
            print(
                f"sessionactors sessions {name}: created a new store at {created!r} "
                "(no file was there); if you meant a store of yours, check the path in "
                f"{given.where()}",
                file=sys.stderr,
            )
        return status
    except KeyboardInterrupt:
        return 130
    except Exception as raised:  # one line, never a traceback (a group: its first error)
        exc: BaseException = raised
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        if isinstance(exc, BrokenPipeError):  # the reader stopped (`... | head`): no error
            quiet_stdout()
            return EXIT_PIPE_CLOSED
        _say_error(args, exc)
        return 1


def _say_error(args: argparse.Namespace, exc: BaseException) -> None:
    """Tell ``exc`` on stderr, in one line, as the command's error."""
    print(
        f"sessionactors sessions {args.sessions_command}: {told_line(args, exc)}",
        file=sys.stderr,
    )


def told_line(args: argparse.Namespace, exc: BaseException) -> str:
    """``exc`` told in one line, as the command line tells it (its advice names the
    command line's own commands on the store as it was given), safe for a terminal."""
    advise = functools.partial(_cli_advice, args.given_store)
    text = " ".join(told(exc, advise).split()) or type(exc).__name__
    if isinstance(exc, SessionNotFoundError) and Advice(kind=AdviceKind.CREATE) in exc._told:
        # (the library's advice is for code; at the command line, the listing helps)
        text = (
            f"session {exc.session_id!r} is not in this store; "
            f"{_listing(args.given_store)} lists the stored sessions"
        )
    elif not isinstance(exc, SessionActorsError | ValueError | OSError):
        text = f"{type(exc).__name__}: {text}"
    return _terminal_safe(text)


def _cli_advice(given: GivenStore, advice: Advice, session_id: str | None) -> str:
    """``advice`` as the command line tells it: its own command on the store ``given``
    where it has one (the library's message names the Python call,
    ``registry.delete('c3')``)."""
    if advice.kind is AdviceKind.DELETE:
        name = "NAME" if session_id is None else shlex.quote(session_id)
        return _to_run(given, functools.partial(delete_command, name))
    return python_advice(advice, session_id)


def _to_run(given: GivenStore, command: Callable[[str], str]) -> str:
    """A command printed for the user to run on the store ``given``, in backquotes:
    ``command`` of the store's option as it was given (see ``GivenStore.option``), and
    for a --store URL whose password shows as ``***``, the advice to put it back."""
    option, redacted = given.option()
    again = " (put the password back in place of ***)" if redacted else ""
    return f"`{command(option)}`{again}"


def _listing(given: GivenStore) -> str:
    """The ``sessions list`` command of the store ``given``, as a hint prints it."""
    return _to_run(given, lambda option: f"python -m sessionactors sessions list {option}".strip())


def quiet_stdout() -> None:
    """Point standard output at the null device, so that the interpreter's last flush
    of what is still buffered for a closed pipe raises nothing at exit."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def open_given(store: Store, given: GivenStore, *, write: bool) -> Store:
    """The store ``given``, opened read-only for reads: for writes, a SQLite file that a
    process has opened shared (its lock file is there) is opened shared too."""
    if isinstance(store, MemoryStore):  # (an import there would be lost at exit)
        raise ValueError(
            f"{given.shown()}: a store inside one process, this command's own, empty, "
            "gone when it ends; give the store of your server (sqlite:///... or redis://...)"
        )
    if write and isinstance(store, SQLiteStore) and not store.shared:
        path = store.path
        if os.path.exists(f"{path}.lock"):
            store = SQLiteStore(path, shared=True)
    return store


async def _with_store(
    store: Store, command: Callable[[Store, argparse.Namespace], Awaitable[int]], args: Any
) -> int:
    try:
        return await command(store, args)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await store.aclose()


def _out(text: str = "") -> None:
    sys.stdout.write(_terminal_safe(text) + "\n")


# ---- list -----------------------------------------------------------------------


def _parse_meta(pairs: Sequence[str]) -> dict[str, Any]:
    wanted: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--meta {pair!r}: write KEY=VALUE, e.g. --meta tenant=acme")
        try:
            wanted[key] = json.loads(text)
        except ValueError:
            wanted[key] = text
    return wanted


def _info_json(info: SessionInfo) -> dict[str, Any]:
    return {
        "name": info.session_id,
        "agent": info.agent,
        "status": info.status.value,
        "message_count": info.message_count,
        "updated_at": info.updated_at.isoformat(),
        "metadata": metadata_json(info.metadata),
        "pending_reviews": info.pending_reviews,
        "usage": to_json(info.usage),
    }


async def _list(store: Store, args: argparse.Namespace) -> int:
    infos = await list_stored(
        store,
        status=Status(args.status) if args.status else None,
        metadata=_parse_meta(args.meta),
        limit=args.limit,
        after=args.after,
        active_before=args.active_before,
        damaged=functools.partial(_say_damaged, args.given_store),
        unreadable=_say_unreadable,
    )
    if not infos:
        await say_if_empty(store, args.given_store)
    if args.json:
        _out(json_text([_info_json(i) for i in infos]))
        return 0
    for info in infos:
        meta = json_text(metadata_json(info.metadata))
        _out(
            f"{info.session_id}\t{info.status.value}\t{info.message_count} messages\t"
            f"{info.updated_at.isoformat(timespec='seconds')}\t{meta}"
        )
    return 0


async def say_if_empty(store: Store, given: GivenStore, command: str = "list") -> None:
    """Say on stderr when the store holds no session at all: an empty listing of it
    means a wrong store URL (a mistyped ?prefix=, another database number) more often
    than a store emptied, and [] alone would pass a check that nothing is left."""
    if isinstance(store, PagedStore):
        some = await store.list_page(after=None, limit=1)
    else:
        some = await store.list_sessions()
    if some:
        return
    prefix = getattr(store, "prefix", None)
    where = given.where()
    if isinstance(store, SQLiteStore):
        text = (
            f"the sqlite store at {str(store.path)!r} holds no sessions: check that {where} "
            "names the file that your server uses"
        )
    elif isinstance(prefix, str):
        text = (
            f"the store at {redact(given.url)} holds no sessions under prefix {prefix!r}: "
            f"check {where} (its database number, and ?prefix= if your server opens "
            "RedisStore(..., prefix=...))"
        )
    else:
        text = f"the store at {redact(given.url)} holds no sessions: check {where}"
    print(f"sessionactors sessions {command}: {_terminal_safe(text)}", file=sys.stderr)


def _say_damaged(given: GivenStore, raw: bytes) -> None:
    """Say on stderr that a stored name, ``raw``, is not UTF-8, and how to remove it:
    with the command that does, which names the store as it was given (the same
    ``--store-file``; for ``SESSIONACTORS_STORE``, nothing), a ``--store`` URL with
    ``***`` in place of its password (never printed), to put back."""
    shown = shell_quoted(raw)
    text = (
        f"a stored session's name is not UTF-8 (damaged data): {shown}; it is left out "
        f"of the listing and no request can reach it; remove it with "
        f"{_to_run(given, functools.partial(delete_command, shown))}"
    )
    print(f"sessionactors sessions list: {_terminal_safe(text)}", file=sys.stderr)


def _say_unreadable(name: str, why: str) -> None:
    """Say on stderr that the listing entry of session ``name`` cannot be read, and
    how it was listed (``why``)."""
    text = f"session {name!r}: {why}"
    print(f"sessionactors sessions list: {_terminal_safe(text)}", file=sys.stderr)


# ---- show, export, tail ------------------------------------------------------------


async def _show(store: Store, args: argparse.Namespace) -> int:
    state = await read_session(store, args.name)
    events = (await read_events(store, args.name, 0))[1] if args.events else None
    if args.json:
        body = state_to_json(state)
        body["system_prompt"] = state.system_prompt
        body["turn_count"] = state.turn_count
        if events is not None:
            body["events"] = [event_to_json(e) for e in events]
        _out(json_text(body))
        return 0
    _print_state(state, sys.stdout)
    if events is not None:
        _out("events (journaled):")
        for event in events:
            _out(f"  {json_text(event_to_json(event))}")
    return 0


def _print_state(state: SessionState, out: TextIO) -> None:
    def line(text: str = "") -> None:  # a text's own lines indented below its first
        out.write(_terminal_safe(text).replace("\n", "\n        ") + "\n")

    line(f"session {state.session_id}")
    line(f"  status: {state.status.value}   agent: {state.agent}   seq: {state.event_seq}")
    line(f"  created: {state.created_at.isoformat()}   updated: {state.updated_at.isoformat()}")
    line(f"  metadata: {json_text(metadata_json(state.metadata))}")
    if state.system_prompt is not None:
        line(f"  system prompt: {state.system_prompt}")
    line(f"  summary: {state.summary if state.summary else '(none)'}")
    if state.open_turn is not None:
        line(f"  open turn: {state.open_turn.turn_id}")
    line(f"pending reviews: {len(state.reviews)}")
    for review in state.reviews:
        call = review.tool_call
        line(f"  {review.id}: {call.name}({call.arguments})  since {review.created_at.isoformat()}")
    line(f"messages: {len(state.messages)}")
    ended = {turn.message_id: turn for turn in state.turns}  # (by its user message: the last)
    asked = ""  # the id of the last user message so far
    for message in state.messages:
        if message.role is Role.USER:
            asked = message.id
        flags = f" ({_interrupted(ended.get(asked))})" if message.interrupted else ""
        line(f"  [{message.role.value}] {message.content}{flags}")
        for call in message.tool_calls:
            line(f"      calls {call.name}({call.arguments}) as {call.id}")


def _interrupted(turn: TurnRecord | None) -> str:
    """How an interrupted reply is marked: with how its turn ended (``turn``, the record
    of the turn that answered the user message before it, if kept) and, for a failure,
    the kind of its error ("ModelError"), not the error's words: they may hold what the
    model's provider answered, keys included (``show --events`` prints them whole)."""
    if turn is None or turn.status not in (TurnStatus.FAILED, TurnStatus.CANCELLED):
        return "interrupted"
    if turn.status is TurnStatus.CANCELLED:
        return f"interrupted: turn {turn.turn_id} was cancelled"
    kind = (turn.error or "").partition(":")[0]  # (stored as "Kind: its message")
    return f"interrupted: turn {turn.turn_id} failed" + (f": {kind}" if kind.isidentifier() else "")


async def _export(store: Store, args: argparse.Namespace) -> int:
    state = await read_session(store, args.name)
    _out(json_text(dump_export(state, exported_at=utcnow()), indent=2))
    return 0


async def _tail(store: Store, args: argparse.Namespace) -> int:
    name = args.name
    validate_name(name)
    after = args.after
    stored = False  # (the session was read: a later "not stored" means it was deleted)
    if after is None and not args.no_follow:  # follow from now on
        try:
            if is_new_file(store):  # (with --wait: a store file not made yet holds nothing)
                raise SessionNotFoundError(f"session {name!r} is not stored", session_id=name)
            state = await read_session(store, name)
            stored = True
            after = state.event_seq
            if args.wait and state.created_at >= _process_started():
                # stored after tail started (and before its first read, a process's
                # start-up taking a moment): followed from its first event, as when waited for
                after = 0
        except SessionNotFoundError:
            if not args.wait:
                raise _not_stored_yet(name, args.given_store) from None
            after = 0  # (stored later: followed from its first event)
    if after is None:  # with --no-follow, print what is stored
        after = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            warned = False
            waiting = False  # (said so on stderr)
            last: tuple[int, str] | None = None  # the seq and JSON of the last event printed
            failing_since: float | None = None  # while the store does not answer
            while True:
                try:  # from the last event printed on: to check it is still there
                    if not stored and is_new_file(store):  # (--wait: the file is not made yet)
                        raise SessionNotFoundError(
                            f"session {name!r} is not stored", session_id=name
                        )
                    trimmed, events = await read_events(
                        store, name, after if last is None else last[0] - 1
                    )
                except StoreError as exc:  # unavailable for a moment: say so, and retry
                    now = trio.current_time()
                    if (
                        args.no_follow
                        or isinstance(exc, _LASTING)
                        or (failing_since is not None and now - failing_since > TAIL_OUTAGE)
                    ):
                        raise
                    if failing_since is None:
                        failing_since = now
                        text = _terminal_safe(" ".join(str(exc).split()))
                        print(
                            f"sessionactors sessions tail: {text}; retrying for up to "
                            f"{TAIL_OUTAGE:.0f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                    await trio.sleep(TAIL_INTERVAL)
                    continue
                except SessionNotFoundError:
                    if stored:
                        raise SessionNotFoundError(
                            f"session {name!r} is not stored (deleted?); nothing more to follow",
                            session_id=name,
                        ) from None
                    if not args.wait:
                        raise _not_stored_yet(name, args.given_store) from None
                    if not waiting:  # wait until it is stored
                        waiting = True
                        where = (
                            f"; the SQLite file {str(store.path)!r} does not exist yet "
                            f"(check the path in {args.given_store.where()} if no server "
                            "is about to make it)"
                            if is_new_file(store)
                            else ""
                        )
                        print(
                            f"sessionactors sessions tail: session {name!r} is not stored "
                            f"yet{_terminal_safe(where)}; waiting for it (Ctrl-C to stop)",
                            file=sys.stderr,
                            flush=True,
                        )
                    await trio.sleep(TAIL_INTERVAL)
                    continue
                stored = True
                if last is not None and trimmed < last[0]:  # is it still there?
                    again = (events[0].seq, json_text(event_to_json(events[0]))) if events else None
                    if again != last:
                        raise SessionNotFoundError(
                            f"session {name!r} was deleted and a new session was stored under "
                            "its name (or it was imported again) since the events printed; "
                            "nothing more to follow: run tail again to follow the new one",
                            session_id=name,
                        )
                if failing_since is not None:
                    failing_since = None
                    print(
                        "sessionactors sessions tail: the store answers again; following on",
                        file=sys.stderr,
                        flush=True,
                    )
                events = [event for event in events if event.seq > after]
                if trimmed > after and not warned:
                    print(
                        f"sessionactors sessions tail: the events of session {name!r} up to "
                        f"seq {trimmed} were compacted away; following from there",
                        file=sys.stderr,
                    )
                    warned = True
                try:
                    with _signals_raise():  # (a write to a reader that stopped blocks)
                        for event in events:
                            text = json_text(event_to_json(event))
                            _out(text)
                            after = max(after, event.seq)
                            last = (event.seq, text)
                        sys.stdout.flush()
                except _Signalled:  # stopped as when it waits: what is unwritten is dropped
                    quiet_stdout()
                    nursery.cancel_scope.cancel()
                    return 0
                if args.no_follow:
                    nursery.cancel_scope.cancel()
                    return 0
                await trio.sleep(TAIL_INTERVAL)
    return 0


#: When this module was imported: ``_process_started`` where the system does not say.
_IMPORTED: Final = time.time()


def _process_started() -> datetime:
    """When this process started, by the wall clock: as Linux's /proc tells it (the
    command run, before the interpreter's start-up), elsewhere when this module was
    imported."""
    started = _IMPORTED
    with contextlib.suppress(OSError, ValueError, IndexError, AttributeError):
        with open("/proc/self/stat", "rb") as stat:  # (its fields after the ")" of its name)
            ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])  # starttime, field 22
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        started = min(started, time.time() - age)
    return datetime.fromtimestamp(started, UTC)


def _not_stored_yet(name: str, given: GivenStore) -> SessionNotFoundError:
    return SessionNotFoundError(
        f"session {name!r} is not in this store; {_listing(given)} lists the stored "
        "sessions; to wait for a session that is about to be stored, pass --wait",
        session_id=name,
    )


class _Signalled(Exception):
    """SIGINT or SIGTERM, come while ``tail`` was writing."""


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While ``tail`` writes, SIGINT and SIGTERM raise ``_Signalled`` at once. trio's
    handlers only note a signal for its loop, and a write blocked on a full pipe (a
    reader that stopped reading) would then go on waiting: the signal would be lost."""

    def handler(signum: int, frame: object) -> None:
        raise _Signalled(signal.Signals(signum).name)

    previous = [(s, signal.signal(s, handler)) for s in (signal.SIGINT, signal.SIGTERM)]
    try:
        yield
    finally:
        for signum, old in previous:
            signal.signal(signum, old)


# ---- import, delete ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def joined(store: Store) -> AsyncIterator[Registry]:
    """An agentless registry on a store that connects workers: it joins them through
    the router, so a delete reaches the worker that holds the session's shard. It
    wakes nothing, so it holds no lease, and it leaves the workers on exit."""
    async with open_registry(store=store, worker_id=new_id("sessionactors-cli")) as registry:
        yield registry


@contextlib.asynccontextmanager
async def leased(store: Store, name: str, doing: str) -> AsyncIterator[None]:
    """Hold ``name``'s lease while a write command changes it, on a SQLite file that
    several processes share (refused while another process holds it); say clearly
    when a file held by another process refuses to open."""
    try:
        if not getattr(store, "shared_by_workers", False):
            yield
            return
        owner = f"sessionactors-cli-{os.getpid()}"
        lease = await store.claim(name, owner, LEASE_TTL)
        if lease is None:
            route = f"/sessions/{urllib.parse.quote(name, safe='')}"
            how = f" (a server run with `sessionactors serve`: DELETE {route})"
            raise LeaseHeldError(
                f"session {name!r} is live in another process (it holds the session's lease), "
                f"so it cannot be {doing} from here; do it through that process"
                f"{how if doing == 'deleted' else ''}, or retry once the session hibernates",
                session_id=name,
            )
        try:
            yield
        finally:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(10),
                contextlib.suppress(SessionActorsError),
            ):
                await store.release(name, lease)
    except StoreError as exc:
        if "in use by" not in str(exc):
            raise
        problem = str(exc).removeprefix(f"session {name!r}: ")
        raise StoreError(
            f"session {name!r} cannot be {doing}: {problem}. A server run with "
            "'python -m sessionactors serve' shares its file with --store "
            "'sqlite:///PATH?shared=true'",
            session_id=name,
        ) from exc


def _read_document(path: str) -> Any:
    where = "standard input" if path == "-" else repr(path)
    if path == "-":
        if sys.stdin is None:  # (started with it closed, as by `<&-`)
            raise OSError("standard input is closed; pass the export as FILE, or pipe it in")
        data = _read_bounded(sys.stdin.buffer, where)
    else:
        try:
            file = open(path, "rb")  # noqa: SIM115 (closed below)
        except OSError as exc:  # (a directory, a missing file, no permission)
            why = _UNREADABLE.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()
            raise OSError(
                f"cannot read {where}: {why}; pass a file written by export "
                "(or - for standard input)"
            ) from None
        with file:
            data = _read_bounded(file, where)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise ValueError(f"{where} is not JSON ({exc}); pass a file written by export") from None


#: What an import FILE that cannot be opened is, by the error's number.
_UNREADABLE: Final = {
    errno.EISDIR: "it is a directory",
    errno.ENOENT: "it does not exist",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.EACCES: "permission denied",
}


def _read_bounded(file: BinaryIO, where: str) -> bytes:
    """What ``file`` holds, refused (before it is all read) when it is larger than any
    export: a device that never ends (/dev/zero) or a huge file is no export."""
    size = 0  # (unknown for a pipe or a device)
    with contextlib.suppress(OSError, ValueError):
        size = os.fstat(file.fileno()).st_size
    if size > MAX_IMPORT_BYTES:
        raise ValueError(_too_large(where, size))
    data = file.read(MAX_IMPORT_BYTES + 1)
    if len(data) > MAX_IMPORT_BYTES:
        raise ValueError(_too_large(where, len(data)))
    return data


def _too_large(where: str, size: int) -> str:
    return (
        f"{where} holds over {MAX_IMPORT_BYTES:,} bytes ({size:,}), more than an export of "
        "the largest session; pass a file written by export"
    )


async def _import(store: Store, args: argparse.Namespace) -> int:
    document = _read_document(args.file)
    if args.rename is not None:
        validate_name(args.rename)
    state = load_export(document, name=args.rename)
    name = state.session_id
    if args.rename is None:  # the export's own name is input too: refuse what spawn refuses
        try:
            validate_name(name)
        except InvalidSessionNameError as exc:
            raise InvalidSessionNameError(
                f"the export holds an invalid session name: {exc}; "
                "import it under a valid name with --as NAME",
                session_id=None,
            ) from None
    try:
        async with contextlib.AsyncExitStack() as stack:
            registry = None
            if isinstance(store, RoutingStore):
                registry = await stack.enter_async_context(joined(store))
            await store_imported(store, registry, state, "imported")
    except SessionExistsError:
        raise SessionExistsError(
            f"session {name!r} already exists in this store; import it under another "
            "name with --as NAME, or delete the stored one first",
            session_id=name,
        ) from None
    _out(f"imported session {name!r} ({len(state.messages)} messages)")
    return 0


async def store_imported(
    store: Store, registry: Registry | None, state: SessionState, doing: str
) -> None:
    """Store ``state`` (made by ``as_imported``) in ``store`` as a new session: through
    ``registry`` (``joined``) on a store that connects workers, stored as a spawn is
    (it wakes where it is used); else under the session's lease on a file that
    processes share (``leased``, which says it cannot be ``doing``). Raises
    ``SessionExistsError`` if the store holds the name."""
    if registry is not None:
        await create_session(registry, state)
        return
    name = state.session_id
    snapshot = dump_snapshot(state)
    info = dump_info(LiveSession(state).info())
    async with leased(store, name, doing):
        await store_new(store, name, snapshot, info, state.event_seq)


def _check_names(names: Sequence[str]) -> None:
    """Refuse the command, before anything is deleted, if a name is not one a session
    can have (a damaged name, given as `list` shows it, is one)."""
    for name in names:
        if damaged_name(name) is None:
            validate_name(name)


def _sessions_named(names: Sequence[str]) -> str:
    """``session 'a'``, ``sessions 'a' and 'b'``, ``sessions 'a', 'b' and 'c'``."""
    shown = [_shown(name) for name in names]
    if len(shown) == 1:
        return f"session {shown[0]}"
    return f"sessions {', '.join(shown[:-1])} and {shown[-1]}"


def _shown(name: str) -> str:
    raw = damaged_name(name)
    return repr(name) if raw is None else shell_quoted(raw)


async def _delete(store: Store, args: argparse.Namespace) -> int:
    """Delete each session named, in turn: a line on stdout for each deleted, a line on
    stderr for each that is not stored or is live in another process (status 1 then);
    any other error (the store's) ends the command, leaving the names after it."""
    status = 0
    async with contextlib.AsyncExitStack() as stack:
        registry = None
        if isinstance(store, RoutingStore):  # by the worker that runs it or holds its shard
            registry = await stack.enter_async_context(joined(store))
        for name in args.names:
            try:
                await _delete_one(store, registry, name)
            except (SessionNotFoundError, LeaseHeldError) as exc:
                _say_error(args, exc)
                status = 1
            else:
                _out(f"deleted session {_shown(name)}")
    return status


async def _delete_one(store: Store, registry: Registry | None, name: str) -> None:
    raw = damaged_name(name)
    if raw is not None:
        # a name that damage left not UTF-8, given as `list` shows it ($'\xff19'): its
        # rows or keys, by their bytes (no process holds it: no request reaches it)
        if not await store.delete(name):
            raise SessionNotFoundError(
                f"session {shell_quoted(raw)} is not in this store", session_id=None
            )
    elif registry is not None:
        await registry.delete(name)
    else:
        async with leased(store, name, "deleted"):
            if not await store.delete(name):
                raise SessionNotFoundError(f"session {name!r} is not stored", session_id=name)


#: The commands that only read their store (``copy`` writes another one: its target).
_READS: Final = frozenset({"list", "show", "export", "tail", "copy"})
