"""``python -m sessionactors serve``: the gateway under hypercorn's trio worker."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import math
import os
import signal
import sys
import traceback
import urllib.parse
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any, Final

import trio

import sessionactors as sa

from .._cli_given import read_given
from .._names import terminal_safe
from ..stores._url import is_new_file, open_store
from ._app import SessionsApp, create_app
from ._sockets import abort_connections, count_connections

__all__ = ["main", "open_store", "serve"]

log = logging.getLogger("sessionactors.http")

#: The environment variable that holds the token when neither ``--token`` nor
#: ``--token-file`` gives one.
TOKEN_VARIABLE: Final = "SESSIONACTORS_TOKEN"

#: The levels of ``--log-level``.
LOG_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

#: The form of ``serve``'s log lines on standard error.
LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: The form of an access log line: the client's address, the request line (its path
#: without the query, where a browser's ``?access_token=`` is), status, bytes, seconds.
ACCESS_LOG_FORMAT: Final = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'

#: The signals that shut the server down: SIGINT (Ctrl-C), SIGTERM (what platforms send
#: before they kill a process) and SIGHUP (its terminal closed, a supervisor's reload),
#: unless the process started with SIGHUP ignored (see ``_stop_signals``).
STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: The exit status of a server stopped at once by a second signal (a clean stop's is 0).
EXIT_FORCED: Final = 1

#: Seconds the server waits after a signal for the requests in flight, for an app that
#: serves a registry it was given (whose turns run on until its owner closes it).
GRACEFUL_SECONDS: Final = 10.0

#: Seconds the server waits, once the app's own registry closed (its turns in flight had
#: their ``shutdown_grace`` and their callers their answers), for the responses still
#: being written.
CLOSED_SECONDS: Final = 5.0

#: Seconds between two looks, while the server waits for its connections to end, at
#: whether any is still open (a connection's task may outlive its connection).
LOOK_SECONDS: Final = 0.05


def load_agents(spec: str) -> dict[str, sa.Agent]:
    """``MODULE:ATTRIBUTE`` naming an Agent (its key is ATTRIBUTE) or a mapping of them,
    importable from the current directory."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--agent {spec!r}: write MODULE:ATTRIBUTE, e.g. myagents:support")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"--agent {spec!r}: {exc}") from None
    except Exception as exc:  # its code raised (a SyntaxError, say): one line, no traceback
        text = " ".join(str(exc).split())
        raise ImportError(
            f"--agent {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {text}"
        ) from None
    try:
        value = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"--agent {spec!r}: module {module_name!r} has no {attribute!r}") from None
    if isinstance(value, sa.Agent):
        return {attribute: value}
    if (
        isinstance(value, Mapping)
        and value
        and all(isinstance(a, sa.Agent) for a in value.values())
    ):
        return {str(key): agent for key, agent in value.items()}
    raise ValueError(
        f"--agent {spec!r} is a {type(value).__name__}, not a sessionactors.Agent or a "
        "mapping of names to Agents"
    )


async def serve(
    app: SessionsApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    access_log: bool = False,
    drain_delay: float = 0.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn's trio worker until SIGINT, SIGTERM or SIGHUP (not
    SIGHUP if the process started with it ignored, as under ``nohup``: it stays ignored).

    ``task_status.started(url)`` gives the address it listens on (``port=0``
    picks a free one), once it listens and the app's registry is open (its store
    answered the startup check). The registry is opened first: a startup that
    fails raises, and the address is never bound; a signal that comes before it
    listens stops it there (it raises ``KeyboardInterrupt``, binding nothing). On the
    first signal it drains the app (``/healthz`` and every new request are answered
    503, but an event stream's with an empty stream that says when to come back,
    every answer says ``Connection: close``, event streams and WebSockets end at
    once); after ``drain_delay`` seconds (0 by default: set it to the time your load
    balancer takes to see the 503 of ``/healthz``) it stops listening, closes the idle
    connections and closes the app's registry while the requests in flight wait (once
    the messages storing new sessions have their turns accepted, 10 seconds at most:
    so a stop takes at most ``drain_delay`` + 10 + ``shutdown_grace`` + 5 + 5 seconds,
    the last two only for clients that read nothing): turns
    running get the registry's ``shutdown_grace``, then their callers are answered (a
    reply, or 503 for a turn cut off) and every session is hibernated; then it waits
    up to 5 seconds for the answers still being written, resets the connections still
    open (a client that reads nothing holds its connection in a socket write), and
    returns once no connection is left. ``ValueError`` for a ``drain_delay`` that is
    not a number of seconds, 0 or more. For an app
    that serves a registry it was given, it waits up to 10 seconds for the requests in
    flight instead (close the registry once it returns). A second signal resets every
    connection and stops at once: the turns in flight are cut (what they streamed is
    kept, marked interrupted), every session is still hibernated, and it raises
    ``KeyboardInterrupt`` (the command line's exit status 1) so that a forced stop is
    told from a clean one.
    Call it from the main thread (signals are delivered there).

    It configures no logging: it writes through the ``logging`` module, its own lines
    (the signal that stops it, a forced stop) to the ``sessionactors.http`` logger,
    hypercorn's errors to ``hypercorn.error`` and, with ``access_log=True``, a line per
    request to ``hypercorn.access`` (the address, the method and path without the query,
    where a browser's ``?access_token=`` is, the status, the bytes and the seconds it
    took; the path's control characters, a newline say, escaped as ``\\u000a``, so that
    a client cannot forge a line of the log). ``python -m sessionactors serve`` sends
    them all to standard error.
    """
    hypercorn = _hypercorn()
    config = hypercorn.config.Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    # (loggers, not hypercorn's own handlers: the application's logging places them)
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = logging.getLogger("hypercorn.access") if access_log else None
    config.access_log_format = ACCESS_LOG_FORMAT
    config.logger_class = _access_logger(hypercorn)
    # (not hypercorn's deadline, which would cut a request waiting for its turn's answer
    # while the registry still gives that turn its grace: serve bounds the wait below)
    config.graceful_timeout = math.inf
    if not 0 <= drain_delay < math.inf:
        raise ValueError(f"drain_delay={drain_delay!r}: give a number of seconds, 0 or more")
    draining, stop, served = trio.Event(), trio.Event(), trio.Event()
    began = forced = False
    bound_to: tuple[str, int] | None = None
    try:
        lifespan = app.lifespan()  # (opened here, so that hypercorn binds only once it is)
        asgi: Any = functools.partial(_opened_lifespan, app)
        bound = CLOSED_SECONDS
    except TypeError:  # an app that serves a registry it was given: nothing to open
        lifespan, asgi = contextlib.nullcontext(), app
        bound = GRACEFUL_SECONDS
    if access_log:  # (only its lines read the status noted: no wrapper of every send else)
        asgi = functools.partial(_noting_status, asgi)
    with trio.open_signal_receiver(*_stop_signals()) as signals:
        async with trio.open_nursery() as nursery:  # (cancelled by a second signal)

            async def on_signals() -> None:
                nonlocal forced
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if draining.is_set():  # the second one: stop now
                        log.warning(
                            "%s again: stopped at once (a forced stop): the turns in flight "
                            "are cut, kept as far as they went, and their connections reset",
                            name,
                        )
                        forced = True
                        if bound_to is not None:
                            abort_connections(bound_to)
                        nursery.cancel_scope.cancel()
                        return
                    app.drain()
                    draining.set()
                    if bound_to is None or drain_delay == 0:
                        log.info("%s: shutting down (again to stop at once)", name)
                        stop.set()
                    else:
                        log.info(
                            "%s: shutting down: answering 503 for %s s (--drain-delay) before "
                            "it stops listening (again to stop at once)",
                            name,
                            drain_delay,
                        )
                        nursery.start_soon(stop_after_delay)

            async def stop_after_delay() -> None:
                await trio.sleep(drain_delay)
                stop.set()

            async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
                await hypercorn.trio.serve(
                    asgi, config, shutdown_trigger=stop.wait, task_status=task_status
                )
                served.set()
                stop.set()  # (were it to end on its own, close the registry too)

            nursery.start_soon(on_signals)
            async with lifespan:  # the registry: open (its store checked) before the bind
                if not stop.is_set():  # (a signal while it opened: serve nothing)
                    binds: list[str] = await nursery.start(run_server)
                    bound_to = _address(binds[0])
                    task_status.started(binds[0])
                    began = True
                    await stop.wait()
                # the signal: the server stops listening and waits for the requests in
                # flight, while the registry closes here (its turns' grace, hibernation),
                # which answers those that wait on a turn
            if began:
                with trio.move_on_after(bound):
                    await _wait_served(served, bound_to)
                if not served.is_set() and bound_to is not None:
                    # a client that reads nothing holds its connection in a socket write
                    # that hypercorn shields from cancellation: cut those connections
                    if reset := abort_connections(bound_to):
                        log.warning(
                            "reset %d connection(s) whose answers were still being written "
                            "%s s after the registry closed (their clients read nothing)",
                            reset,
                            bound,
                        )
                    with trio.move_on_after(bound):
                        await _wait_served(served, bound_to)
            nursery.cancel_scope.cancel()  # served and shut down: stop watching signals
        if not began:  # a signal came before it served (a second one cut the opening)
            raise KeyboardInterrupt("stopped by a signal before it served")
        if forced:
            raise KeyboardInterrupt("stopped at once by a second signal")


async def _wait_served(served: trio.Event, address: tuple[str, int] | None) -> None:
    """Wait until the server has ended, or no connection it accepted on ``address`` is
    open any more: a connection's task may wait on after its connection closed (under
    hypercorn, one whose client sent its next request before the answer it waited for
    said that the connection closes), with nothing left to write to anyone."""
    while not served.is_set():
        if address is not None and count_connections(address) == 0:
            return
        with trio.move_on_after(LOOK_SECONDS):
            await served.wait()


def _hypercorn() -> ModuleType:
    """hypercorn, imported when a server starts: only ``serve`` needs it, so that an app
    served otherwise (uvicorn) imports this package without it. ``ImportError`` saying
    which extra installs it, where it is not installed."""
    try:
        import hypercorn.config
        import hypercorn.logging
        import hypercorn.trio
    except ImportError as exc:
        raise ImportError(
            "sessionactors.http.serve (and `python -m sessionactors serve`) runs hypercorn's "
            "trio worker, which is not installed: pip install 'sessionactors[http]' "
            f"(or hypercorn) ({exc})"
        ) from exc
    return hypercorn


@functools.cache
def _access_logger(hypercorn: ModuleType) -> type:
    """hypercorn's logger class, whose access log lines have their control characters
    escaped: a request's path is percent-decoded, so a client could put a newline in it
    (and a forged line of the log after it) or a terminal's escape sequence."""

    class AccessLogger(hypercorn.logging.Logger):  # type: ignore[name-defined,misc]
        def atoms(self, request: Any, response: Any, request_time: float) -> Mapping[str, str]:
            if response is None and _BEGAN in request:
                # a response cut before its end (an event stream its client left, or that
                # the stop ended): the status it began with, as the client got it
                response = {"status": request[_BEGAN], "headers": []}
            atoms: Any = super().atoms(request, response, request_time)
            for key, value in atoms.items():
                if isinstance(value, str):
                    atoms[key] = terminal_safe(value, one_line=True)
            return atoms  # type: ignore[no-any-return]

    return AccessLogger


def _stop_signals() -> tuple[signal.Signals, ...]:
    """``STOP_SIGNALS`` but SIGHUP where the process inherited it ignored (started under
    ``nohup``, or by a supervisor that sends it for a reload the server does not do):
    listening for it would replace that choice, and a SIGHUP would stop the server."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return tuple(s for s in STOP_SIGNALS if s != signal.SIGHUP)
    return STOP_SIGNALS


def _address(url: str) -> tuple[str, int] | None:
    """The host and port of a URL that hypercorn says it listens on."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None or parts.port is None:
        return None
    return parts.hostname, parts.port


#: The key of a request's ASGI scope under which ``_noting_status`` keeps the status its
#: response began with.
_BEGAN: Final = "sessionactors.status"


async def _noting_status(app: Any, scope: Any, receive: Any, send: Any) -> None:
    """``app``, noting in an HTTP request's scope the status its response began with,
    until it ends: hypercorn writes a response cut before its end (an event stream its
    client left, or that the stop ended) to the access log without one, and
    ``AccessLogger`` writes this one instead."""
    if scope["type"] != "http":
        await app(scope, receive, send)
        return

    async def noting(message: Any) -> None:
        if message["type"] == "http.response.start":
            scope[_BEGAN] = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            # ended: hypercorn writes its line with its status (after a line without one
            # if the connection closed as it ended, which stays so: one status a request)
            scope.pop(_BEGAN, None)
        await send(message)

    await app(scope, receive, noting)


async def _opened_lifespan(app: SessionsApp, scope: Any, receive: Any, send: Any) -> None:
    """``app`` for a server, whose lifespan events ``serve`` answers itself: it opened
    the app's lifespan before the server started, and closes it after the server ends."""
    if scope["type"] != "lifespan":
        await app(scope, receive, send)
        return
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def configure_logging(level: str, *, access_log: bool = False) -> None:
    """Send log records to standard error, a line each with its time and level: the
    ``sessionactors`` loggers' from ``level`` (``"debug"``, ``"info"``, ...) up, other
    libraries' from warnings up (everything at ``"debug"``), and the access log's lines
    with ``access_log``. For the command line, which is the application: the library
    itself configures no logging."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    chosen = LOG_LEVELS[level]
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(chosen if chosen == logging.DEBUG else max(chosen, logging.WARNING))
    logging.getLogger("sessionactors").setLevel(chosen)
    if access_log:  # (asked for: whatever the level)
        logging.getLogger("hypercorn.access").setLevel(logging.INFO)


def _telemetry() -> sa.Telemetry:
    """``--otel``: OpenTelemetry with the global providers (made after the agents'
    module was imported, which may set them up; a provider set later is used too)."""
    try:
        from ..otel import OpenTelemetry
    except ImportError as exc:
        raise ImportError(
            f"--otel needs the OpenTelemetry API: pip install 'sessionactors[otel]' ({exc})"
        ) from None
    return OpenTelemetry()


def read_token(args: argparse.Namespace) -> str | None:
    """The token that ``--token``, ``--token-file`` or the environment gives, or None
    (a file's or the variable's surrounding whitespace dropped alike). Raises
    ``ValueError`` for a token file that cannot be read, is empty, holds more than one
    line or is far larger than a token, and for both options given."""
    given = read_given(
        args.token,
        args.token_file,
        option="--token",
        file_option="--token-file",
        variable=TOKEN_VARIABLE,
        what=("the secret", "a secret"),
    )
    return None if given is None else given[0]


def main(args: argparse.Namespace) -> int:
    """Serve the command line's store and agents; the exit status."""
    configure_logging(args.log_level, access_log=args.access_log)
    try:
        _hypercorn()
        store = open_store(args.given_store.url, given=args.given_store)
        agents = load_agents(args.agent)
        # (a mistyped path, or a file deleted while the server was stopped, makes a new
        # one: said once the store has opened)
        new_file = is_new_file(store)
        app = create_app(
            store=store,
            agents=agents,
            token=read_token(args),
            trusted_origins=args.trusted_origin,
            cors_origins=args.cors_origin,
            shutdown_grace=args.shutdown_grace,
            idle_timeout=args.idle_timeout,
            lease_ttl=args.lease_ttl,
            telemetry=_telemetry() if args.otel else None,
        )
    except (ValueError, ImportError) as exc:
        print(f"sessionactors serve: {exc}", file=sys.stderr)
        return 2

    started = False

    async def run() -> None:
        nonlocal started
        async with trio.open_nursery() as nursery:
            url = await nursery.start(
                functools.partial(
                    serve,
                    app,
                    host=args.host,
                    port=args.port,
                    access_log=args.access_log,
                    drain_delay=args.drain_delay,
                )
            )
            started = True
            if new_file:
                log.warning(
                    "created a new, empty store at %r (no file was there); if you meant a "
                    "store of yours, stop the server and check the path in %s",
                    store.path,
                    args.given_store.where(),
                )
            registry = app.registry
            worker = ""
            if isinstance(registry, sa.Registry) and getattr(store, "shared_by_workers", False):
                # the id that the workers' leases and errors name: which process this is,
                # and its store (the database, the prefix): which workers it joins
                worker = f" as worker {registry.worker_id} on {store!r}"
            print(f"sessionactors: serving {sorted(agents)} at {url}/{worker}", flush=True)
            log.info("serving %s at %s/%s", sorted(agents), url, worker)

    try:
        trio.run(run)
    except KeyboardInterrupt:  # (a signal before the server took them over)
        return EXIT_FORCED if started else 130
    except BaseException as exc:
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in _leaves(exc)):
            # a second signal while it served (a forced stop, logged), or a signal while
            # the registry opened (nothing served)
            return EXIT_FORCED if started else 130
        refused: BaseException | None = _startup_refusal(exc)
        text = " ".join(str(refused).split())
        if refused is None and (refused := _bind_refusal(exc)) is not None:
            text = f"cannot listen on --host {args.host!r} --port {args.port}: {refused}"
        if refused is None:
            raise
        doing = "failed while serving" if started else "cannot start"  # (closing, say)
        print(f"sessionactors serve: {doing}: {text}", file=sys.stderr)
        return 1
    return 0


def _startup_refusal(error: BaseException) -> sa.SessionActorsError | None:
    """The library's error that failed the app's startup (its store refused it, say),
    found in what ``serve`` raised, or None."""
    for leaf in _leaves(error):
        if isinstance(leaf, sa.SessionActorsError):
            return leaf
    return None


def _bind_refusal(error: BaseException) -> OSError | None:
    """The error of the server's bind (an address in use, a host that does not resolve),
    found in what hypercorn raised, or None."""
    for leaf in _leaves(error):
        if isinstance(leaf, OSError) and any(
            frame.f_code.co_name == "bind" or "hypercorn" in frame.f_code.co_filename
            for frame, _ in traceback.walk_tb(leaf.__traceback__)
        ):
            return leaf
    return None


def _leaves(error: BaseException) -> Iterator[BaseException]:
    """The exceptions in ``error`` that are not groups (``error`` itself if it is none)."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error
