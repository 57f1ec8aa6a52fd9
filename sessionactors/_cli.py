"""The ``sessionactors`` command (``python -m sessionactors``): ``demo`` (the main job),
``demo-cluster``, ``chat``, ``serve`` and ``sessions`` (see ``_cli_sessions``)."""

from __future__ import annotations

import argparse
import codecs
import io
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import trio

from ._agent import Agent
from ._cli_copy import add_parser as add_copy_parser
from ._cli_copy import read_target
from ._cli_sessions import EXIT_PIPE_CLOSED, add_store_arguments, quiet_stdout
from ._cli_sessions import add_parser as add_sessions_parser
from ._cli_sessions import run as run_sessions
from ._errors import SessionActorsError
from ._events import Delta, TurnFailed
from ._model import Model
from ._names import is_url, json_escape, redact, redact_urls
from ._names import terminal_safe as _terminal_safe
from ._registry import open_registry
from .stores._sqlite import SQLiteStore
from .stores._url import STORE_VARIABLE, GivenStore, read_store

__all__ = ["main"]


def _say(text: str = "") -> None:
    print(text, flush=True)


async def _chat(args: argparse.Namespace, model: Model) -> None:
    agent = Agent(model=model, system_prompt=args.system_prompt)
    store = SQLiteStore(args.db, shared=args.shared)
    async with open_registry(store=store, agents={"chat": agent}) as registry:
        ref = await registry.get_or_spawn(args.session)
        history = await ref.history()
        _say(f"session {args.session!r} ({len(history)} messages so far); an empty line quits")
        prompt = "> " if sys.stdin.isatty() else ""  # (at a terminal; none for a script)
        while True:
            print(prompt, end="", flush=True)
            # (abandoned on Ctrl-C: the wait for a line ends at once, not at the next line)
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line.strip():
                return
            async with ref.stream(line.strip()) as events:
                async for event in events:
                    if isinstance(event, Delta):
                        # (the model's text: an escape in it never reaches the terminal raw)
                        print(_terminal_safe(event.text), end="", flush=True)
                    elif isinstance(event, TurnFailed):  # say why, in one line
                        error = _terminal_safe(" ".join(event.error.split()))
                        print(f"sessionactors chat: the turn failed: {error}", file=sys.stderr)
            _say()


def _at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is less than {lowest}")
        return value

    return parse


def _seconds(*, zero: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            least = "0 or more" if zero else "more than 0"
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, {least}")
        return value

    return parse


def _port(text: str) -> int:
    value = _at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return value


def _host(text: str) -> str:
    if not text.strip():  # (an unset variable, as in --host "$HOST", would bind them all)
        raise argparse.ArgumentTypeError(
            "the host is empty, which would listen on every interface; give an address "
            "(0.0.0.0 to listen on every interface)"
        )
    return text


def _secret(text: str) -> str:
    if not text.strip():  # (an unset variable, as in --token "$TOKEN", lets anyone in)
        raise argparse.ArgumentTypeError("the token is empty; give a secret")
    return text


def _arguments_shown(unknown: Sequence[str]) -> str:
    """Arguments a command does not take, as its error repeats them. The value of an
    option it does not take (``--tok=VALUE``, the argument after ``--tokn``, ``-tVALUE``)
    may be a secret given to a misspelt option: it shows as ``***``, or, a URL (a
    store's given to ``--stroe``), with ``***`` in place of its password. Other
    arguments are shown as :func:`_value_shown` shows them."""
    shown: list[str] = []
    after_option = False
    for token in unknown:
        name, equals, value = token.partition("=")
        if _OPTION.fullmatch(token):
            shown.append(token)
            after_option = True
            continue
        if _OPTION.fullmatch(name) and equals:
            shown.append(f"{name}={_value_shown(value, secret=True)}")
        elif token.startswith("-") and not after_option:  # (-tVALUE: a short option's)
            shown.append(f"{token[:2]}***")
        else:
            shown.append(_value_shown(token, secret=after_option))
        after_option = False
    return " ".join(shown)


def _value_shown(value: str, *, secret: bool = False) -> str:
    """A value as a refusal repeats it: a URL with ``***`` in place of its password, a
    plain word (a misspelt command or choice) as it is unless it is the value of an
    option the command does not take (``secret``), anything else as ``***`` (it may be
    a secret given where the command did not expect it)."""
    if is_url(value):
        return redact(value)
    return value if _WORD.fullmatch(value) and not secret else "***"


#: An option's name (``--store-file``, ``-h``), which a refusal shows as it is.
_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9_-]*|-[A-Za-z]")
#: A plain word (``serv``, ``runing``, ``store-file``), a short number (``-1``,
#: ``0.5``, ``90d``) or a date and time (``2026-13-01``, ``2026-01-31T25:00Z``), which a
#: refusal shows as it is.
_WORD = re.compile(
    r"[a-z]{1,32}(?:[-_][a-z]{1,32}){0,3}|[-+]?[0-9.]{1,12}[a-z]{0,2}"
    r"|[0-9]{4}-[0-9]{2}-[0-9]{2}(?:[T ][0-9]{2}(?::[0-9]{2}){0,2}(?:\.[0-9]{1,6})?)?"
    r"(?:Z|[+-][0-9]{2}(?::?[0-9]{2})?)?"
)
#: The values argparse's refusals repeat, quoted as ``repr`` quotes them: its own, and
#: those of the options' types (``argument --port: '80a' is not a port``).
_REFUSED_VALUE = re.compile(
    r"(invalid choice: |ignored explicit argument |invalid [\w ]+ value: |argument [^:']*: )"
    r"(?:'(?P<single>[^']*)'|\"(?P<double>[^\"]*)\")"
)


def _refusal_shown(message: str) -> str:
    """argparse's refusal ``message`` with each value it repeats shown as
    :func:`_value_shown` shows it, and the password of any URL in it as ``***``."""

    def shown(match: re.Match[str]) -> str:
        quote = "'" if match.group("single") is not None else '"'
        value = match.group("single") if quote == "'" else match.group("double")
        return f"{match.group(1)}{quote}{_value_shown(value)}{quote}"

    return redact_urls(_REFUSED_VALUE.sub(shown, message))


class _Parser(argparse.ArgumentParser):
    """Errors in arguments are one line on stderr (and exit status 2), where a URL's
    password shows as ``***``, and so does a value refused that may be a secret (see
    ``_value_shown``). An option is never taken by an abbreviation of its name: a
    misspelt option is refused, rather than taken for another (``--store`` and
    ``--store-file`` begin alike). The parsers of subcommands are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # (argparse repeats what it refuses: a store URL given to --stor=, a value that
        # is not one of the choices, a command it has not; a secret given to an option
        # before the command is taken for the command)
        self.exit(2, f"{self.prog}: {_refusal_shown(message)} (see {self.prog} --help)\n")


def _given(
    parser: argparse.ArgumentParser,
    prog: str,
    read: Callable[[], GivenStore | None],
    missing: str,
) -> GivenStore:
    """The store that ``read`` reads from the command's options; the command ends with
    status 2 if they are wrong (its error) or give none (``no {missing}``)."""
    try:
        given = read()
    except ValueError as exc:
        parser.exit(2, f"{prog}: {exc}\n")
    if given is None:
        parser.exit(2, f"{prog}: no {missing} (see {prog} --help)\n")
    return given


def _escape_unwritable(error: UnicodeError) -> tuple[str, int]:
    """The codec error handler of a standard output that is not UTF-8: a character
    past ASCII as JSON escapes it, which in a JSON string means the same character."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    chars = error.object[error.start : error.end]
    return "".join(json_escape(ch) for ch in chars), error.end


_UNWRITABLE = "sessionactors.escape"
codecs.register_error(_UNWRITABLE, _escape_unwritable)


def main(argv: Sequence[str] | None = None) -> None:
    out = sys.stdout
    if isinstance(out, io.TextIOWrapper) and codecs.lookup(out.encoding).name != "utf-8":
        # (an ASCII or Latin-1 locale: what a command prints, any text, is written as
        # ASCII, so that its JSON, an export's, reads back as UTF-8 as well)
        out.reconfigure(encoding="ascii", errors=_UNWRITABLE)
    parser = _Parser(
        prog="sessionactors",
        description="Run LLM conversations as actors: a demo, a chat, an HTTP server, and "
        "the sessions of a store (list, show, export, import, delete, tail, copy).",
        epilog="Each command has its own --help. Operating a store: the project's "
        "docs/howto/operations.md",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job on the embedded SQLite store")
    demo.add_argument(
        "--sessions",
        type=_at_least(4),
        default=1000,
        metavar="N",
        help="how many sessions to spawn (at least 4; default 1000)",
    )
    demo.add_argument(
        "--turns",
        type=_at_least(1),
        default=3,
        metavar="N",
        help="how many turns each session takes (default 3)",
    )
    demo.add_argument(
        "--path", default=None, help="a new SQLite file to create (default: a temporary one)"
    )
    sub.add_parser("demo-cluster", help="three workers on one local redis-server; one is killed")
    chat = sub.add_parser("chat", help="chat with an OpenAI-compatible server")
    chat.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    chat.add_argument("--model", required=True)
    chat.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    chat.add_argument("--session", default="chat")
    chat.add_argument("--db", default="sessionactors-chat.db", help="SQLite file")
    chat.add_argument(
        "--shared",
        action="store_true",
        help="share the file with other processes (a server on sqlite:///FILE?shared=true), "
        "with leases: one process serves a session at a time",
    )
    chat.add_argument("--system-prompt", default="You are a helpful assistant.")
    serve = sub.add_parser("serve", help="serve sessions over HTTP, with a chat page (extra http)")
    add_store_arguments(serve, "sqlite:///path.db, memory:// or redis://...")
    serve.add_argument("--agent", required=True, help="MODULE:ATTRIBUTE: an Agent or a mapping")
    serve.add_argument("--host", type=_host, default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000, help="0 picks a free one")
    serve.add_argument(
        "--token",
        type=_secret,
        default=None,
        help="require 'Authorization: Bearer TOKEN' (a token on the command line shows in "
        "the process list: prefer --token-file or SESSIONACTORS_TOKEN)",
    )
    serve.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="read the token from this file (one line; a trailing newline is dropped); "
        "without --token or --token-file, the token is SESSIONACTORS_TOKEN if it is set",
    )
    serve.add_argument(
        "--trusted-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin (https://app.example.com) whose pages may open WebSockets and "
        "send forms, besides this server's own: the public one behind a proxy that "
        "rewrites Host (repeat for more)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin (http://localhost:5173) whose pages may call the API from the "
        "browser (CORS, with credentials; trusted as --trusted-origin is); exact origins "
        "only, never '*' (repeat for more)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds(zero=True),
        default=10.0,
        metavar="SECONDS",
        help="how long turns in flight may run on after SIGTERM (default 10)",
    )
    serve.add_argument(
        "--drain-delay",
        type=_seconds(zero=True),
        default=0.0,
        metavar="SECONDS",
        help="after SIGTERM, go on listening this long, answering 503 (/healthz too), before "
        "it stops listening: your load balancer's health check interval times its "
        "unhealthy threshold (default 0)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=_seconds(zero=False),
        default=None,
        metavar="SECONDS",
        help="hibernate a session idle this long (default: never)",
    )
    serve.add_argument(
        "--lease-ttl",
        type=_seconds(zero=False),
        default=30.0,
        metavar="SECONDS",
        help="on a store shared by workers: how soon a dead worker's sessions move (default 30)",
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="what goes to standard error (default info)",
    )
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log a line per request (address, method, path without its query, status)",
    )
    serve.add_argument(
        "--otel",
        action="store_true",
        help="report traces and metrics through OpenTelemetry's global providers, which the "
        "--agent module sets up (or opentelemetry-instrument); needs sessionactors[otel]",
    )
    add_copy_parser(add_sessions_parser(sub))
    args, unknown = parser.parse_known_args(argv)
    # (the command's name, as its errors begin)
    prog = " ".join(
        ["sessionactors", args.command, getattr(args, "sessions_command", None) or ""]
    ).strip()
    if unknown:  # named with the command that refuses them, whose --help lists its own
        words = list(sys.argv[1:] if argv is None else argv)
        before = words[: words.index(args.command)] if args.command in words else words
        if any(token in before for token in unknown):  # given to the top command
            prog = "sessionactors"
        shown = _arguments_shown(unknown)
        parser.exit(2, f"{prog}: unrecognized arguments: {shown} (see {prog} --help)\n")
    if args.command in ("serve", "sessions"):  # its store: --store, --store-file or variable
        args.given_store = _given(
            parser,
            prog,
            lambda: read_store(args.store, args.store_file),
            f"store given: pass --store URL or --store-file PATH, or set {STORE_VARIABLE}",
        )
    if getattr(args, "sessions_command", None) == "copy":  # and the store to copy to
        args.given_target = _given(
            parser,
            prog,
            lambda: read_target(args),
            "store to copy to given: pass --to URL or --to-file PATH",
        )
    if args.command == "sessions":
        raise SystemExit(run_sessions(args))
    if args.command == "serve":
        from .http._serve import main as serve_main

        raise SystemExit(serve_main(args))
    if args.command == "chat":
        from .models._openai import OpenAIChatModel

        try:  # (an OPENAI_API_KEY set but empty is no key, as for a local server)
            model = OpenAIChatModel(args.base_url, args.model, api_key=args.api_key or None)
        except (TypeError, ValueError) as exc:
            chat.error(str(exc))
        try:
            trio.run(_chat, args, model)
        except KeyboardInterrupt:  # Ctrl-C: the conversation is stored; no traceback
            raise SystemExit(130) from None
        except BrokenPipeError:
            quiet_stdout()
            raise SystemExit(EXIT_PIPE_CLOSED) from None
        except SessionActorsError as exc:  # one line, no traceback
            text = " ".join(str(exc).split())
            if "in use by process" in text and not args.shared:
                text += "; for chat, pass --shared"
            print(f"sessionactors chat: {text}", file=sys.stderr)
            raise SystemExit(1) from None
        return
    if args.command == "demo-cluster":
        from ._demo_cluster import demo_cluster

        raise SystemExit(demo_cluster())
    if args.command == "demo":
        from ._demo import run_demo

        if args.path is not None and os.path.lexists(args.path):  # never into a real store
            demo.error(f"--path {args.path!r} exists; the demo creates a new file: name one")
        if args.path is not None:  # can it be made? (said before the demo prints anything)
            try:
                os.close(os.open(args.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                os.remove(args.path)
            except OSError as exc:
                print(
                    f"sessionactors demo: cannot create --path {args.path!r} "
                    f"({exc.strerror}); name a new file in a directory that exists and "
                    "can be written",
                    file=sys.stderr,
                )
                raise SystemExit(1) from None
        try:
            run_demo(args.path, args.sessions, args.turns)
        except KeyboardInterrupt:
            raise SystemExit(130) from None
        except Exception as raised:  # (a group: its first error)
            error: BaseException = raised
            while isinstance(error, BaseExceptionGroup) and error.exceptions:
                error = error.exceptions[0]
            if isinstance(error, BrokenPipeError):  # the reader stopped (`... | head`)
                quiet_stdout()
                raise SystemExit(EXIT_PIPE_CLOSED) from None
            if not isinstance(error, SessionActorsError | OSError):
                raise
            print(f"sessionactors demo: {' '.join(str(error).split())}", file=sys.stderr)
            raise SystemExit(1) from None
    else:  # pragma: no cover
        parser.print_help(sys.stderr)
