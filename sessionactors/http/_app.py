"""The ASGI gateway: routes, server-sent events, the WebSocket, errors and authorization.

The same code serves under trio (hypercorn's trio worker, with a
``sessionactors.Registry``) and under asyncio (uvicorn, with a
``sessionactors.aio.Registry``): both registries have the same methods, and
everything else here goes through anyio, which runs on either loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hmac
import http
import importlib.resources
import inspect
import ipaddress
import json
import logging
import re
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, Literal, assert_never, cast
from urllib.parse import quote, unquote, unquote_to_bytes, urlsplit

import anyio
import attrs
import sniffio
import trio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException, WebSocketException
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

import sessionactors as sa

from .. import aio
from .._errors import Advice, AdviceKind, has_private, shown, told, unmarked
from .._names import as_session_id, terminal_safe, validate_name
from .._ref import check_message, check_text, joined, taken_back
from ..aio._registry import on_trio, trio_turn
from . import _cors
from ._json import (
    LOGGED,
    dumps,
    error_json,
    error_status,
    event_to_json,
    failed_told,
    metadata_json,
    outcome_to_json,
    plain_error,
    private_told,
    reply_to_json,
    state_to_json,
    to_json,
    unmarked_told,
)
from ._sockets import WRITE_BYTES, WriteGuard
from ._sse import (
    RETRY_MS,
    STALL_HEARTBEATS,
    EventStreamResponse,
    FrameCache,
    Select,
    Stream,
    StreamHooks,
    frame,
)

__all__ = ["Action", "Authorize", "SessionsApp", "create_app"]

log = logging.getLogger("sessionactors.http")

#: What a request does, as the ``action`` argument of ``authorize``.
Action = Literal["list", "read", "send", "events", "cancel", "review", "delete", "websocket"]

#: ``authorize(request, session_name, action)``: True lets the request through (see
#: :func:`create_app` for what it may raise).
Authorize = Callable[[HTTPConnection, str | None, Action], bool | Awaitable[bool]]

AnyRegistry = sa.Registry | aio.Registry
AnyRef = sa.SessionRef | aio.SessionRef

#: How long a server's startup waits for its store to answer (see ``_first_read``).
STARTUP_STORE_WAIT: Final = 5.0

#: The longest a server's startup waits for its store's first answer, retries included:
#: a store whose calls never return (one of your own without timeouts) fails it then.
STARTUP_STORE_BOUND: Final = 30.0

#: The statuses of a request to send again in a moment (``Retry-After``).
_RETRY_SOON: Final = frozenset({429, 503})

#: How long ``GET /healthz`` waits for the store to answer before it answers 503.
HEALTH_STORE_WAIT: Final = 2.0

#: How long the lifespan's close waits for the first messages that are storing their
#: sessions to reach the sessions' mailboxes before it closes the registry, in seconds.
FIRST_MESSAGES_WAIT: Final = 10.0


@attrs.define(eq=False)
class _FirstMessage:
    """A message that may create its session, from before the drain until it is in the
    session's mailbox (or failed): the lifespan closes the registry once none is left,
    so that no session is stored for a message the closing registry then refuses."""

    on_end: Callable[[], None]
    ended: bool = False

    def end(self) -> None:
        """It is in the mailbox, or failed (idempotent)."""
        if not self.ended:
            self.ended = True
            self.on_end()


@attrs.define(eq=False)
class _StoreCheck:
    """A read of the store that ``GET /healthz`` probes share while it runs."""

    #: Set when the read ended, with an answer or (its probe gone) without one.
    done: anyio.Event = attrs.field(factory=anyio.Event)
    #: What it found wrong: "" for nothing, None while it runs or if it ended unanswered.
    problem: str | None = None


async def _agents(registry: AnyRegistry) -> list[str]:
    if isinstance(registry, sa.Registry):
        return list(registry.agents)

    async def names(trio_registry: sa.Registry) -> list[str]:
        return list(trio_registry.agents)

    return await on_trio(registry, names, None)


async def _first_read(registry: AnyRegistry) -> None:
    """Read the store once: a store this process cannot use (a SQLite file another
    server writes, a Redis that does not answer) fails the startup, not every request
    after it. A store error a retry may fix is tried again for ``STARTUP_STORE_WAIT``
    seconds (a store restarting as the server starts); one that no retry fixes
    (``StoreConfigurationError``, or ``StoreNotDurableError``: the server's
    persistence) fails at once; a store that gives no answer in
    ``STARTUP_STORE_BOUND`` seconds fails it with a StoreError."""
    deadline = anyio.current_time() + STARTUP_STORE_WAIT
    tried = False
    with anyio.move_on_after(STARTUP_STORE_BOUND):
        while True:
            try:
                await registry.sessions(limit=1)
                return
            except (sa.StoreConfigurationError, sa.StoreNotDurableError):
                raise
            except sa.StoreError as exc:
                if anyio.current_time() >= deadline:
                    raise
                if not tried:  # (once: the last error is the startup's failure, if it fails)
                    log.warning(
                        "the store did not answer at startup; trying again for up to %g s: %s",
                        STARTUP_STORE_WAIT,
                        exc,
                    )
                    tried = True
                await anyio.sleep(0.5)
    raise sa.StoreError(
        f"the store did not answer the server's first read of it within "
        f"{STARTUP_STORE_BOUND:g} s: check that it is reachable; a store of your own "
        "should bound its calls, as the built-in stores do (see the custom store how-to)"
    )


_OUTCOMES: Final = (sa.TurnFinished, sa.TurnFailed, sa.TurnCancelled, sa.ReviewRequested)


class _RequestError(Exception):
    """A request the gateway refuses before it reaches the registry (with ``headers``
    for its answer, besides the gateway's own)."""

    def __init__(
        self, status: int, name: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = plain_error(name, message, status)
        self.headers = headers


def _refused_by_app(exc: HTTPException) -> _RequestError:
    """An ``HTTPException`` that the app's ``authorize`` raised, as the gateway's refusal:
    its status, its detail as the message and its headers."""
    status = exc.status_code
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    name = "".join(word.capitalize() for word in phrase.replace("-", " ").split()) or "HTTPError"
    detail = exc.detail if isinstance(exc.detail, str) else dumps(exc.detail).decode()
    return _RequestError(status, name, detail, exc.headers)


def _routes(scope: Mapping[str, Any]) -> str:
    """The path of the sessions' routes as a client reaches them: under the app's mount
    (the ASGI ``root_path``: a ``Mount("/api", ...)``, a proxy's prefix)."""
    return f"{scope.get('root_path', '')}/sessions"


def _session_route(scope: Mapping[str, Any], name: str) -> str:
    """The path of session ``name``'s routes as a client reaches them."""
    return f"{_routes(scope)}/{quote(name, safe='')}"


#: The chat page may not be framed by another site (clickjacking its buttons) and
#: sends no Referer.
_PAGE_HEADERS: Final = {
    "Content-Security-Policy": "frame-ancestors 'self'",
    "X-Frame-Options": "SAMEORIGIN",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


def _static(name: str) -> bytes:
    return importlib.resources.files("sessionactors.http").joinpath("static", name).read_bytes()


class _Answer(Response):
    """A whole answer (JSON, the chat page) whose client must keep taking it: it is
    written in pieces of :data:`WRITE_BYTES`, and one that its client takes nothing of
    for ``bound`` seconds ends the answer and resets its connection (a client that reads
    nothing would otherwise hold the answer's bytes and its connection until the server
    shuts down: hypercorn's trio worker waits on the socket write, uvicorn keeps what it
    was given). An answer of one piece is written as any other (the socket's buffer
    takes it whole, and ``serve`` resets connections still open at its shutdown)."""

    def __init__(
        self,
        content: bytes,
        *,
        bound: float,
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str,
    ) -> None:
        super().__init__(content, status, headers, media_type)
        self.bound = bound

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = self.body
        if len(body) <= WRITE_BYTES:  # one piece, which the socket's buffer takes whole:
            await super().__call__(scope, receive, send)  # no guard task for most answers
            return
        writes = WriteGuard(scope, send, self.bound)
        async with anyio.create_task_group() as group:
            group.start_soon(writes.guard, group.cancel_scope)
            start = {"type": "http.response.start", "status": self.status_code}
            await writes.send({**start, "headers": self.raw_headers})
            for at in range(0, len(body), WRITE_BYTES):
                piece = body[at : at + WRITE_BYTES]
                more = at + WRITE_BYTES < len(body)
                await writes.send({"type": "http.response.body", "body": piece, "more_body": more})
            group.cancel_scope.cancel()
        if writes.stalled:
            name = scope.get("path_params", {}).get("name")  # (a session's route)
            about = f"session {_name_shown(name)}: " if isinstance(name, str) else ""
            log.warning(
                "%san answer's client took nothing of a 64 KB piece in %s s; ended it",
                about,
                writes.bound,
            )


def create_app(
    registry: sa.Registry | aio.Registry | None = None,
    *,
    token: str | None = None,
    authorize: Authorize | None = None,
    create_sessions: bool = True,
    heartbeat: float = 15.0,
    chat_page: bool = True,
    max_body: int = 16 * 1024 * 1024,
    body_timeout: float = 30.0,
    trusted_origins: Iterable[str] = (),
    cors_origins: Iterable[str] = (),
    cors_headers: Iterable[str] = (),
    **registry_options: Any,
) -> SessionsApp:
    """An ASGI 3 application serving a registry's sessions over HTTP, SSE and WebSocket.

    Two forms:

    - ``create_app(registry)`` with an open registry: a
      ``sessionactors.Registry`` when the app is served by trio (hypercorn's
      trio worker, in the same trio run), a ``sessionactors.aio.Registry``
      when it is served by asyncio (uvicorn, on the same loop).
    - ``create_app(store=..., agents=..., **registry_options)``: the app
      opens the registry itself in the ASGI lifespan, on whichever loop
      serves it, with the arguments of ``sessionactors.open_registry``, and
      closes it (grace, then hibernation) when the server shuts down.

    Options:

    - ``token``: every request to ``/sessions...`` needs
      ``Authorization: Bearer TOKEN`` (or ``?access_token=TOKEN``, for
      browsers' WebSocket and EventSource); otherwise 401. An empty token is
      refused (``ValueError``): an empty bearer token would match it.
    - ``authorize(request, session_name, action)``: called for every request
      to ``/sessions...`` (``session_name`` is None for the listing); a false
      result answers 403. It may be async. It may raise Starlette's (or
      FastAPI's) ``HTTPException``: the answer has its status, detail and
      headers (a WebSocket gets that error and is closed with 4000 + status).
      It may raise Starlette's ``WebSocketException``, as a WebSocket endpoint
      refuses: a WebSocket is closed with its code and reason (cut to the 123
      bytes a close frame carries), and an HTTP request answers 403 with its
      reason as the message. Any other exception answers 500 naming its kind,
      and goes to the log. ``action`` is one of ``"list"``,
      ``"read"``, ``"send"``, ``"events"``, ``"cancel"``, ``"review"``,
      ``"delete"``, ``"websocket"`` (when a WebSocket connects; then each of
      its frames is authorized as the action it does: ``"send"``,
      ``"cancel"``, ``"review"``).
    - ``create_sessions``: whether a message (or a WebSocket) to an unknown
      session creates it (default) or answers 404.
    - ``heartbeat``: seconds of silence after which an event stream sends a
      comment line, so that proxies and browsers keep it open. An event
      stream, and any other answer (a session's JSON, however long its
      history), is written in pieces of 64 KB; one whose client takes nothing
      of a piece for twice this long (a WebSocket message, which cannot be
      split, has twice this long for each 64 KB it carries) is ended and its
      connection reset (the client resumes with ``Last-Event-ID``, or
      ``?after=`` on a WebSocket, or asks again). A client that reads slowly
      but takes 64 KB in that time (about 2 KB/s at the default) gets its
      whole stream or answer.
    - ``chat_page``: serve the chat page at ``/`` and its client at
      ``/sessionactors.js`` (without a ``token`` or an ``authorize``, under the
      ``Host`` names that the routes answer: see ``trusted_origins``).

    ``GET /healthz`` is for load balancers: 200 ``{"status": "ok"}`` while the
    registry is open and its store answers a listing of one session within 2
    seconds, 503 ``{"status": "unavailable"}`` otherwise (also while the app
    drains). It needs no token and passes no ``authorize``: it tells nothing but
    whether the server is ok (the log says why not). Probes that come while a read
    of the store runs wait for its answer rather than reading the store too; an
    answer is not kept once its read ended (the next probe reads again).
    - ``max_body``: the largest request body accepted, in bytes (413 above).
    - ``body_timeout``: the seconds a request body may take to arrive once the
      gateway reads it (408 ``RequestTimeout`` after, and the connection closed): a
      client that sends a large body a byte at a time holds the server's memory for
      no longer. Bodies of JSON are refused (422) if they hold over 100,000 values,
      before they are parsed (small ones swell as they are, and take long: a few
      MiB of ``[{},{},...]`` are millions of dicts).
    - ``trusted_origins``: origins (``"https://app.example.com"``, as browsers
      send them in ``Origin``) whose pages may open WebSockets and send forms
      without a token, besides this server's own: the public origin of a
      gateway behind a reverse proxy that rewrites ``Host``, or an app of yours
      served from another origin. Without a ``token``, the gateway refuses
      such requests from any other origin; without a ``token`` or an
      ``authorize``, it also answers only ``Host`` names that DNS rebinding
      cannot point at it (IP addresses, names of one label, subdomains of
      ``localhost``) and those of these origins (see "Authorization" in the
      HTTP gateway how-to).
    - ``cors_origins``: origins whose pages may call the gateway from the browser
      (CORS): the front end of an app served from another origin, a development
      server on another port. Their preflights are answered, allowing the
      gateway's methods (GET, POST, DELETE) and the headers it reads
      (``Authorization``, ``Content-Type``, ``Idempotency-Key``, ``Last-Event-ID``,
      and ``traceparent`` and ``tracestate``), and every answer to them names their origin, with
      credentials (cookies, for an ``authorize`` that reads them), so that their
      pages read it. They are trusted as ``trusted_origins`` are. Exact origins
      only: ``"*"``, ``"null"`` or anything else that is not an origin raises
      ``ValueError``. A page of any other origin is answered as without this
      option: its preflight is refused (403 ``"CrossOrigin"``), and nothing it
      is answered names its origin, so it reads nothing. With ``cors_origins``,
      every answer says ``Vary: Origin``.
    - ``cors_headers``: headers of your own that ``authorize`` reads (an API key, a
      user's id), which pages of ``cors_origins`` may then send too; any other is
      refused in their preflights. A name that is not an HTTP header's raises
      ``ValueError``.
    """
    if registry is not None and registry_options:
        raise TypeError(
            "create_app() takes either an open registry or the options to open one "
            f"(got both a registry and {sorted(registry_options)})"
        )
    if registry is None and not registry_options.get("agents"):
        raise TypeError(
            "create_app() needs an open registry, or agents={name: Agent(...)} "
            "(and a store=...) to open one in the app's lifespan"
        )
    if registry is not None and not isinstance(registry, sa.Registry | aio.Registry):
        raise TypeError(
            "create_app(registry) takes a sessionactors.Registry or a "
            f"sessionactors.aio.Registry, not {type(registry).__name__}"
        )
    if heartbeat <= 0:
        raise ValueError(f"heartbeat must be a positive number of seconds, not {heartbeat}")
    if token is not None and not token.strip():  # ("Bearer " or ?access_token= matched it)
        raise ValueError(
            f"token {token!r} is empty: anyone would get in with an empty bearer token; "
            "give a secret (e.g. secrets.token_urlsafe()), or token=None for no token"
        )
    return SessionsApp(
        registry,
        registry_options,
        token=token,
        trusted_origins=_origins(trusted_origins, "trusted"),
        cors_origins=_origins(cors_origins, "CORS"),
        cors_headers=_header_names(cors_headers),
        authorize=authorize,
        create_sessions=create_sessions,
        heartbeat=heartbeat,
        chat_page=chat_page,
        max_body=max_body,
        body_timeout=_body_timeout(body_timeout),
    )


def _body_timeout(seconds: object) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(
            f"create_app: body_timeout must be a number of seconds > 0, not {seconds!r:.60}"
        )
    return float(seconds)


class SessionsApp:
    """The ASGI application that :func:`create_app` makes.

    ``registry`` is the registry it serves (None while no lifespan has it open).
    ``lifespan`` opens and closes that registry, for an app that mounts this
    one (``FastAPI(lifespan=gateway.lifespan)``).
    ``drain()`` ends every open event stream and WebSocket and answers later
    requests with 503: call it when shutting down, before the server waits
    for open connections (``python -m sessionactors serve`` does).
    """

    def __init__(
        self,
        registry: AnyRegistry | None,
        registry_options: dict[str, Any],
        *,
        token: str | None,
        trusted_origins: frozenset[str],
        cors_origins: frozenset[str],
        cors_headers: tuple[str, ...],
        authorize: Authorize | None,
        create_sessions: bool,
        heartbeat: float,
        chat_page: bool,
        max_body: int,
        body_timeout: float,
    ) -> None:
        self._registry = registry
        self._options = registry_options
        self._token = token.encode() if token is not None else None
        self._cors = cors_origins
        self._cors_headers = cors_headers
        self._trusted = trusted_origins | cors_origins  # (a page that may read may act)
        self._authorize = authorize
        self._create_sessions = create_sessions
        self._frames = FrameCache()
        self._max_body = max_body
        self._body_timeout = body_timeout
        self._draining = False
        self._first_messages = 0  # (see ``_FirstMessage``)
        self._first_messages_done: anyio.Event | None = None
        self._healthy = True  # (what the last health check found, to log its changes)
        self._store_check: _StoreCheck | None = None  # (the health probes' read under way)
        self._lifespan_began = False  # (an app that opens its registry itself)
        self._in_lifespan = False  # (its lifespan is open now)
        self._streams: set[anyio.CancelScope] = set()
        self._checked_loop = False
        self._portal: Callable[[Callable[[], None]], object] | None = None
        self._loop_thread = 0
        self._hooks = StreamHooks(
            error_response=self._error_response,
            error_json=self._error_json,
            track=self._track,
            untrack=self._untrack,
            heartbeat=heartbeat,
        )
        self._write_bound = STALL_HEARTBEATS * heartbeat
        routes: list[Route | WebSocketRoute] = []
        if chat_page:
            page, client = _static("index.html"), _static("sessionactors.js")
            script = functools.partial(self._page, client, "text/javascript", None)
            routes += [
                Route("/", functools.partial(self._page, page, "text/html", _PAGE_HEADERS)),
                Route("/sessionactors.js", script),
            ]
        routes += [
            Route("/healthz", self._health, methods=["GET"]),
            Route("/sessions", self._list, methods=["GET"]),
            # (one route: a 405 of another method lists both in its Allow)
            Route("/sessions/{name}", self._session, methods=["GET", "DELETE"]),
            Route("/sessions/{name}/messages", self._message, methods=["POST"]),
            Route("/sessions/{name}/events", self._events, methods=["GET"]),
            Route("/sessions/{name}/cancel", self._cancel, methods=["POST"]),
            Route("/sessions/{name}/turns/{turn_id}", self._turn, methods=["GET"]),
            Route("/sessions/{name}/reviews/{review_id}", self._review, methods=["POST"]),
            WebSocketRoute("/sessions/{name}/ws", self._websocket),
        ]
        lifespan = self.lifespan if registry is None else None
        self._app = Starlette(
            routes=routes,
            lifespan=lifespan,
            exception_handlers={HTTPException: self._http_exception},
        )
        # (a path with a slash too many is not found: a redirect would name the caller's
        # Host before the Host check of the routes, and a 307 posts the body there)
        self._app.router.redirect_slashes = False

    def __repr__(self) -> str:
        return f"<SessionsApp registry={self._registry!r}>"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI 3 entry point."""
        if scope["type"] == "http":
            send = functools.partial(self._send_http, send)
            if self._cors:  # (pages of these origins may read the answers: see _cors)
                headers = Headers(scope=scope)
                if _cors.is_preflight(scope["method"], headers):
                    await self._preflight(headers, scope, receive, send)
                    return
                origin = headers.get("origin")
                allowed = origin if origin in self._cors else None
                send = functools.partial(_send_with_origin, send, allowed)
        await self._app(_slashes_in_segments(scope), receive, send)

    async def _preflight(self, headers: Headers, scope: Any, receive: Any, send: Any) -> None:
        """Answer a CORS preflight (of request ``headers``): 204 allowing it, or 403
        saying why not."""
        refused = _cors.refusal(headers, self._cors, self._cors_headers)
        answer: Response
        if refused is None:
            answer = Response(status_code=204, headers=_cors.preflight(headers, self._cors_headers))
        else:
            body = plain_error("CrossOrigin", refused, 403)
            answer = self._json(body, 403, _cors.preflight_vary())
        await answer(scope, receive, send)

    async def _send_http(self, send: Any, message: Any) -> None:
        """``send`` of an HTTP response, which says ``Connection: close`` once the app
        drains: its client then sends its next request on a new connection (to another
        server, through a load balancer), never on this one as the server closes it."""
        if message["type"] == "http.response.start" and self._draining:
            headers = [*message.get("headers", ()), (b"connection", b"close")]
            message = {**message, "headers": headers}
        await send(message)

    @property
    def registry(self) -> sa.Registry | aio.Registry | None:
        """The registry served: for an app that opens its own, None until its lifespan
        opened it and again once the lifespan closed it."""
        return self._registry

    def drain(self) -> None:
        """End every open event stream and WebSocket; answer later requests with 503
        (an event stream's with an empty stream saying ``retry:``, which a browser's
        EventSource follows where a 503 would end it).

        Every answer from then on, those to the requests in flight too, says
        ``Connection: close``, so that its client sends its next request on a new
        connection rather than on this one as the server closes it. It may be called
        from any thread (a signal handler's, a test's).
        """
        self._draining = True
        portal = self._portal
        if portal is not None and threading.get_ident() != self._loop_thread:
            portal(self._end_streams)
        else:
            self._end_streams()

    async def _first_messages_stored(self) -> None:
        """Wait (at most ``FIRST_MESSAGES_WAIT``) until the first messages begun before
        the drain are in their sessions' mailboxes, whose turns the registry's close
        then gives their grace."""
        if self._first_messages:
            self._first_messages_done = anyio.Event()
            try:
                with anyio.move_on_after(FIRST_MESSAGES_WAIT):
                    await self._first_messages_done.wait()
            finally:
                self._first_messages_done = None

    def _first_message(self) -> _FirstMessage:
        """Note a message that may create its session (see ``_FirstMessage``); once
        the drain began, refused with 503 before anything is stored."""
        if self._draining:
            raise _RequestError(
                503, "ShuttingDown", "the server is shutting down; retry in a moment"
            )
        self._first_messages += 1
        return _FirstMessage(self._first_message_ended)

    def _first_message_ended(self) -> None:
        self._first_messages -= 1
        if not self._first_messages and self._first_messages_done is not None:
            self._first_messages_done.set()

    def _end_streams(self) -> None:
        for scope in list(self._streams):
            scope.cancel()

    def _remember_loop(self) -> None:
        """Note the serving loop's thread and how to reach it, for ``drain()``."""
        if self._portal is not None:
            return
        self._loop_thread = threading.get_ident()
        if sniffio.current_async_library() == "trio":
            self._portal = trio.lowlevel.current_trio_token().run_sync_soon
        else:
            self._portal = asyncio.get_running_loop().call_soon_threadsafe

    # ---- plumbing ------------------------------------------------------------------

    def lifespan(self, app: object = None) -> AbstractAsyncContextManager[None]:
        """The app's lifespan: opens its registry, on the loop that runs it, and closes it.

        For an app made by ``create_app(store=..., agents=...)`` mounted inside
        an app of your own (Starlette and FastAPI send no lifespan events to a
        mounted app): give it as that app's lifespan,
        ``FastAPI(lifespan=gateway.lifespan)``, or enter it in yours,
        ``async with gateway.lifespan(app): yield``; your own routes then use
        ``gateway.registry``. ``app`` is ignored (the lifespan protocol passes
        it). On exit it drains the gateway (see ``drain()``), waits (up to 10
        seconds) until the messages over HTTP that were storing their new sessions
        have their turns in the sessions' mailboxes, so that no session is
        stored for a message then refused (a WebSocket opened on a new name just
        before the drain may still leave one), and closes the registry (grace, then
        hibernation). Entered again later (a test
        client per test), it opens a new registry. It raises ``RuntimeError``
        if it is entered again while already open, and ``TypeError`` for an
        app made by ``create_app(registry)``, which serves the registry it
        was given.
        """
        if not self._options:
            raise TypeError(
                "this app serves the registry given to create_app(registry) and has no "
                "lifespan: open and close that registry in your own app's lifespan, or "
                "make the app with create_app(store=..., agents=...) to use its lifespan"
            )
        return self._lifespan()

    @asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[None]:
        if self._in_lifespan:
            raise RuntimeError(
                "this app's lifespan is already open: it opens one registry at a time. "
                "Run it once, either as your app's lifespan (lifespan=gateway.lifespan) "
                "or inside it (async with gateway.lifespan(app)), and serve the gateway "
                "mounted in that app; for a second app, make a second create_app(...)"
            )
        self._in_lifespan = True
        try:
            async with self._open_registry():
                yield
        finally:
            self._in_lifespan = False

    @asynccontextmanager
    async def _open_registry(self) -> AsyncIterator[None]:
        # (a lifespan after an earlier one, as a test suite's: afresh, on its own loop)
        self._lifespan_began = True
        self._registry = None
        self._draining = False
        self._checked_loop = False
        self._portal = None
        self._store_check = None
        self._first_messages = 0  # (one an earlier lifespan never saw end: not waited on)
        library = sniffio.current_async_library()
        opened: AbstractAsyncContextManager[AnyRegistry]
        if library == "trio":
            opened = sa.open_registry(**self._options)
        elif library == "asyncio":
            opened = aio.open_registry(**self._options)
        else:  # pragma: no cover - no other ASGI servers' loops
            raise RuntimeError(f"sessionactors.http runs on trio or asyncio, not {library}")
        self._remember_loop()
        try:
            async with opened as registry:
                await _first_read(registry)
                self._registry = registry
                try:
                    yield
                finally:
                    self.drain()
                    await self._first_messages_stored()
        finally:
            self._registry = None  # (closed: not handed out by ``registry`` any more)

    def _answer(
        self,
        content: bytes,
        media_type: str,
        status: int = 200,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """A whole answer, written to its client under the write bound (see ``_Answer``)."""
        return _Answer(
            content, bound=self._write_bound, status=status, headers=headers, media_type=media_type
        )

    def _json(
        self, data: Any, status: int = 200, headers: Mapping[str, str] | None = None
    ) -> Response:
        """A JSON answer, which no cache may store (it holds a conversation, or tells
        what is true now), unless ``headers`` say otherwise (in whatever case). A 429
        or a 503 (a full mailbox; a server starting, stopping, or whose store failed)
        says when to try again: ``Retry-After: 1``, the moment its message speaks of."""
        given = headers or {}
        if not any(key.lower() == "cache-control" for key in given):
            given = {"cache-control": "no-store", **given}
        if status in _RETRY_SOON and not any(key.lower() == "retry-after" for key in given):
            given = {**given, "retry-after": "1"}
        return self._answer(dumps(data), "application/json", status, given)

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """Starlette's own refusals (no such route, wrong method) as JSON errors too."""
        assert isinstance(exc, HTTPException)
        name = "".join(word.capitalize() for word in exc.detail.split()) or "HTTPError"
        path = request.url.path.replace(_SLASH, "%2F")
        message = f"{request.method} {shown(path)}: {exc.detail.lower()}"
        if exc.status_code == 404:
            message += (
                f"; the routes are under {_routes(request.scope)} (see the HTTP gateway how-to)"
            )
        return self._json(plain_error(name, message, exc.status_code), exc.status_code, exc.headers)

    def _track(self, scope: anyio.CancelScope) -> None:
        """Remember an open stream's scope, so that ``drain()`` can end it."""
        self._remember_loop()
        self._streams.add(scope)
        if self._draining:
            scope.cancel()

    def _untrack(self, scope: anyio.CancelScope) -> None:
        """Forget a stream that has ended."""
        self._streams.discard(scope)

    def _error_body(
        self, error: BaseException, scope: Mapping[str, Any], session: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The status and JSON body that tell a client about ``error`` (a request's,
        whose ASGI ``scope`` places the routes that its advice names)."""
        if isinstance(error, _RequestError):
            body = dict(error.body)
            if session:  # say which session the refused request was for
                named = f"session {_name_shown(session)}"
                if named not in body["message"]:
                    body["message"] = f"{named}: {body['message']}"
                if as_session_id(session) is not None:
                    body["session_id"] = session
            return error.status, body
        if isinstance(error, json.JSONDecodeError):
            refused = _RequestError(422, "InvalidJSON", f"the frame is not valid JSON ({error})")
            return self._error_body(refused, scope, session)
        status = error_status(error)
        return status, self._error_json(error, scope, status)

    def _error_json(
        self, error: BaseException, scope: Mapping[str, Any], status: int | None = None
    ) -> dict[str, Any]:
        """``error`` as JSON, its advice told as an HTTP client follows it (see
        ``_http_advice``), with this app's routes under ``scope``.

        What the server's own parts say of themselves is for its log, not for clients:
        an exception that is not the library's is told by its kind (and logged here);
        a failed turn's or a crash's cause that is not public, by its kind (a failed
        turn's was logged when the turn failed, a crash's is logged here), and such an
        error that does not mark its cause (``unmarked``: from a worker of an older
        version) by its kind only (logged here); a store's failure, as such (its message
        names files and hosts: logged here)."""
        body = error_json(error, status=status)
        advice = functools.partial(self._http_advice, scope)
        message = told(error, advice, private_told)
        if unmarked(error):
            log.warning("a request failed, told to its client by its kind: %s", error)
            message = unmarked_told(error)
        elif isinstance(error, sa.SessionCrashedError):
            # (its cause was logged where it crashed, or is the death of its worker,
            # which that worker's lease told: one line; a cause that is private is told
            # the client by its kind, and here in full; its advice, as the client's)
            whole = told(error, advice) if has_private(error) else message
            log.warning("a request met a crashed session: %s", " ".join(whole.split()))
        elif isinstance(error, sa.StoreError) and not isinstance(error, sa.FencedOutError):
            # (one that no retry fixes, until the operator does: an ERROR, to act on)
            wrong = isinstance(error, sa.StoreConfigurationError)
            log.log(
                logging.ERROR if wrong else logging.WARNING,
                "a request (%s) failed in the store: %s",
                _request_line(scope),
                message,
            )
            session = error.session_id
            about = f"session {session!r}: " if session is not None else ""
            message = (
                f"{about}the server's store failed ({type(error).__name__}); retry in a "
                f"moment ({LOGGED})"
            )
        elif body["status"] > 500 and isinstance(error, sa.SessionActorsError):
            # the shutdown's or a handover's (a turn cut off as the server stops, a session
            # taken over by another worker): the client is told to send it again, and the
            # operator has nothing to act on, so one line (see ``error_status``); a worker
            # that gave no word may be one to look at: a WARNING line
            unreachable = isinstance(error, sa.WorkerUnreachableError)
            log.log(
                logging.WARNING if unreachable else logging.INFO,
                "a request was answered %d (%s): %s",
                body["status"],
                type(error).__name__,
                " ".join(message.split()),
            )
        elif body["status"] >= 500 and not isinstance(error, sa.TurnFailedError):
            # (a failed turn was logged whole when it failed)
            log.error(
                "%s failed: %s%s",
                _request_line(scope),
                type(error).__name__,
                _of_session(error),
                exc_info=error,
            )
            if not isinstance(error, sa.SessionActorsError):
                message = failed_told(error)
        body["message"] = message
        return body

    def _http_advice(self, scope: Mapping[str, Any], advice: Advice, session: str | None) -> str:
        """``advice`` of an error about ``session`` as an HTTP client follows it: with
        the routes under the app's mount, and resuming as the client's route can (a
        WebSocket reads ``?after=``; a turn's stream, POST .../messages, reads no seq:
        the session's events, GET .../events, do)."""
        route = _routes(scope) + "/{name}" if session is None else _session_route(scope, session)
        if scope.get("type") == "websocket":
            resume, after = "reconnect with ?after=", "?after="
        elif scope.get("method") == "GET":
            resume, after = "reconnect with Last-Event-ID: ", "Last-Event-ID, or ?after="
        else:
            resume = f"follow GET {route}/events with Last-Event-ID: "
            after = f"GET {route}/events with Last-Event-ID, or ?after="
        kind = advice.kind
        Kind = AdviceKind
        match kind:
            case Kind.CREATE:
                return self._create_advice(route)
            case Kind.AFTER_PARAM:
                return "?after="
            case Kind.WAIT_FOR_ROOM:
                return "retry in a moment"
            case Kind.WAIT_FOR_HANDOVER | Kind.REOPEN | Kind.OPEN_REGISTRY | Kind.AIO_AGAIN:
                return "send it again in a moment"
            case Kind.AIO_BLOCK:
                return "send it again once the server serves again"
            case Kind.NEW_SESSION:
                return "send to a session of another name"
            case Kind.SPAWN_AFRESH:
                return "send to it again"
            case Kind.DELETE:
                return f"DELETE {route}"
            case Kind.LIST_REVIEWS:
                return f"GET {route} lists them"
            case Kind.RESOLVE_REVIEW:
                review = quote(advice.review_id, safe="")
                return (
                    f'resolve it (POST {route}/reviews/{review} with {{"approve": true or false}})'
                )
            case Kind.RELOAD_STATE:
                return f"reload the state (GET {route}) and resume after its event_seq ({after})"
            case Kind.RELOAD:
                return f"reload the state (GET {route})"
            case Kind.RESUME_AFTER:
                seq = advice.seq
                return f"{resume}{seq}" + ("" if after == "?after=" else f" (or ?after={seq})")
            case Kind.LOST_TURNS | Kind.LOST_OUTCOME | Kind.AIO_LIFESPAN:
                return ""
            case Kind.TURN_IDS:
                return 'take turn ids from the "turn_id" of a message\'s answer or of its events'
            case Kind.TURN_OUTCOME:
                return f"ask GET {route}/turns/{quote(advice.turn_id, safe='')}"
            case Kind.OR_TURN_OUTCOME if advice.turn_id:
                return f"(or GET {route}/turns/{quote(advice.turn_id, safe='')})"
            case Kind.OR_TURN_OUTCOME:
                return f"(GET {route})"
            case Kind.FOLLOW_TURN:
                return f"follow it with GET {route}/events"
            case Kind.IDEMPOTENCY_KEY:
                return '"idempotency_key"'
            case Kind.TALK_TO_IT:
                return 'send its messages without "agent"'
            case _:
                assert_never(kind)

    def _create_advice(self, route: str) -> str:
        """How an HTTP client makes a session that does not exist (at ``route``)."""
        if self._create_sessions:
            return f"send it a message to create it (POST {route}/messages)"
        return "check its name (this server creates no session on a first message)"

    def _error_response(
        self, error: BaseException, scope: Mapping[str, Any], session: str | None = None
    ) -> Response:
        """The JSON response for an error raised while serving a request."""
        status, body = self._error_body(error, scope, session)
        headers = _auth_header(status)
        if isinstance(error, _RequestError) and error.headers:  # the app's own win
            given = {key.lower() for key in error.headers}
            ours = {key: val for key, val in (headers or {}).items() if key.lower() not in given}
            headers = {**ours, **error.headers}
        return self._json(body, status, headers)

    def _registry_now(self) -> AnyRegistry:
        registry = self._registry
        if registry is None and not self._lifespan_began and not self._draining:
            raise _RequestError(
                500,
                "NoRegistry",
                "the app has no registry: create_app(store=..., agents=...) opens one in "
                "its ASGI lifespan, which never ran (a mounted app gets no lifespan "
                "events); give it to the app it is mounted in, "
                "FastAPI(lifespan=gateway.lifespan) or Starlette(lifespan=gateway.lifespan) "
                "(or enter it in yours: async with gateway.lifespan(app): yield), "
                "or open the registry in your own app's lifespan and serve "
                "create_app(registry), or serve this app itself",
            )
        if self._lifespan_began and not self._in_lifespan:
            raise _RequestError(
                500,
                "NoRegistry",
                "the app has no registry: its lifespan, which opens and closes it, has "
                "ended and is not running again; send requests while it runs (in tests: "
                "inside `with TestClient(app) as client:`; a bare TestClient(app) runs "
                "no lifespan)",
            )
        if registry is None and not self._draining:
            raise _RequestError(
                503, "Starting", "the server is opening its registry; retry in a moment"
            )
        if registry is None or self._draining:
            raise _RequestError(
                503, "ShuttingDown", "the server is shutting down; retry in a moment"
            )
        if not self._checked_loop:
            library = sniffio.current_async_library()
            trio_registry = isinstance(registry, sa.Registry)
            if trio_registry != (library == "trio"):
                raise _RequestError(
                    500,
                    "WrongLoop",
                    f"this app serves a {'trio' if trio_registry else 'asyncio'} registry "
                    f"but runs on {library}: under uvicorn, open the registry with "
                    "sessionactors.aio.open_registry; under hypercorn's trio worker, with "
                    "sessionactors.open_registry (or let create_app(store=..., agents=...) "
                    "open it)",
                )
            self._checked_loop = True
        return registry

    async def _admit(self, request: HTTPConnection, name: str | None, action: Action) -> None:
        """Refuse (raise _RequestError) a request that is not allowed."""
        _refuse_bent_path(request)
        self._registry_now()
        if self._token is not None:
            given = _bearer(request)
            if given is None or not hmac.compare_digest(given.encode(), self._token):
                raise _RequestError(
                    401,
                    "Unauthorized",
                    "this server needs a token: send 'Authorization: Bearer <token>' "
                    "(or ?access_token=<token> from a browser's WebSocket or EventSource)",
                )
        else:
            if self._authorize is None:
                _refuse_rebindable(request, self._trusted)
            _refuse_forgeable(request, self._trusted)
        await self._authorized(request, name, action)

    async def _authorized(self, request: HTTPConnection, name: str | None, action: Action) -> None:
        """Refuse (raise _RequestError) what ``authorize`` does not allow: a request,
        or one frame of a WebSocket (as the action it does). A ``WebSocketException``
        it raises is raised on for a WebSocket (which closes with its code and
        reason), and refuses a request with 403. A library error it lets out (reading
        the session's metadata) is answered as the route answers it."""
        if self._authorize is not None:
            try:
                allowed = self._authorize(request, name, action)
                if inspect.isawaitable(allowed):
                    allowed = await allowed
            except HTTPException as exc:  # (FastAPI's is one too) refused as it says
                raise _refused_by_app(exc) from exc
            except WebSocketException as exc:  # (FastAPI's is Starlette's)
                if request.scope["type"] == "websocket":
                    raise  # closes the socket with its code and reason
                what = f"session {_name_shown(name)}" if name is not None else "the sessions"
                message = exc.reason or f"this request may not {action} {what}"
                raise _RequestError(403, "Forbidden", message) from exc
            except sa.SessionActorsError:  # (reading the session: as the route answers it)
                raise
            except Exception as exc:  # the app's fault: its kind to the client, all to the log
                log.error("authorize(%r, %r) raised", name, action, exc_info=exc)
                raise _RequestError(
                    500, type(exc).__name__, f"authorize failed with {type(exc).__name__}; {LOGGED}"
                ) from exc
            if not allowed:
                what = f"session {_name_shown(name)}" if name is not None else "the sessions"
                raise _RequestError(403, "Forbidden", f"this request may not {action} {what}")

    async def _exists(self, registry: AnyRegistry, name: str) -> bool:
        if name in registry.live():
            return True
        if isinstance(registry, sa.Registry):
            return await registry.store.exists(name)
        return await on_trio(registry, lambda trio_registry: trio_registry.store.exists(name), name)

    async def _existing_ref(
        self, registry: AnyRegistry, name: str, scope: Mapping[str, Any]
    ) -> AnyRef:
        ref = registry.ref(name)  # validates the name
        if not await self._exists(registry, name):
            advice = self._create_advice(_session_route(scope, name))
            raise sa.SessionNotFoundError(
                f"session {name!r} does not exist; {advice}", session_id=name
            )
        return ref

    async def _ref_to_write(
        self, registry: AnyRegistry, name: str, agent: str | None, *, socket: bool = False
    ) -> AnyRef:
        """The session ``name``, created with ``agent`` if it is new (and this server
        creates sessions); ``socket``: for a WebSocket, which names its agent in its URL."""
        if not self._create_sessions:
            return registry.ref(name)
        # (not "live, so it exists": a read of a name not stored has a live actor while
        # it loads; get_or_spawn waits for that)
        try:
            return await registry.get_or_spawn(name, agent=agent)
        except ValueError as exc:  # no agent named, or one the registry lacks
            if isinstance(exc, sa.SessionActorsError):
                raise
            if socket:
                first, where = "the WebSocket", "as ?agent= on the WebSocket's URL"
            else:
                first, where = "its first message", "in the message's JSON"
            agents = sorted(await _agents(registry))
            if not agents:  # (a registry that manages sessions: any agent, run elsewhere)
                raise _RequestError(
                    422,
                    "ValueError",
                    f"session {name!r} is new, and {first} names no agent; this server has "
                    "no agents of its own (servers with the agent run its turns): send "
                    f'"agent" naming the one it runs with ({where})',
                ) from None
            if agent is not None:
                what = f"{first} names the agent {shown(agent)}, which this server lacks"
            else:
                what = f"it is new, and {first} names no agent"
            raise _RequestError(
                422,
                "InvalidRequest",
                f"session {name!r}: {what}; this server's agents are {agents}: send "
                f'"agent" as one of them ({where})',
            ) from None

    async def _submit(
        self, registry: AnyRegistry, ref: AnyRef, text: str, key: str | None
    ) -> sa.Turn | aio.Turn:
        # A live session's full mailbox answers 429 at once: an HTTP client retries
        # later instead of holding a connection open. Elsewhere (hibernated, on
        # another worker) submit wakes or forwards it.
        if ref.session_id in registry.live():
            return ref.submit_nowait(text, idempotency_key=key)
        return await ref.submit(text, idempotency_key=key)

    async def _body(self, request: Request, fields: tuple[str, ...]) -> dict[str, Any]:
        """The request's JSON object, which may hold only ``fields`` (a misspelled
        field, ignored, would silently lose what it asks for: refused)."""
        size = int(request.headers.get("content-length") or 0)
        if size > self._max_body:
            raise _too_large(self._max_body)
        chunks = bytearray()
        try:
            with anyio.fail_after(self._body_timeout):
                async for chunk in request.stream():
                    chunks += chunk
                    if len(chunks) > self._max_body:
                        raise _too_large(self._max_body)
        except TimeoutError:
            raise _RequestError(
                408,
                "RequestTimeout",
                f"the request body did not arrive within {self._body_timeout:g} s "
                "(body_timeout); send it whole at once",
                {"connection": "close"},
            ) from None
        except ClientDisconnect:  # (gone: nobody reads an answer, nothing failed here)
            raise _RequestError(
                499, "ClientDisconnected", "the client closed its connection mid-body"
            ) from None
        if not chunks:
            return {}
        try:
            data = _loads(chunks, "the request body")
        except (ValueError, RecursionError) as exc:  # (nested too deep to decode)
            raise _RequestError(
                422, "InvalidJSON", f"the request body is not valid JSON ({exc}); send an object"
            ) from None
        if not isinstance(data, dict):
            raise _RequestError(422, "InvalidRequest", "the request body must be a JSON object")
        _only(data, fields, "the request body")
        _check_strings(data, "the request body")
        return data

    async def _handle(
        self,
        request: Request,
        action: Action,
        handler: Callable[[AnyRegistry, str], Awaitable[Response]],
    ) -> Response:
        name = _param(request, "name")
        try:
            await self._admit(request, name or None, action)
            if name:  # (before a check of the body repeats it)
                validate_name(name)
            return await handler(self._registry_now(), name)
        except Exception as exc:
            return self._error_response(exc, request.scope, name or None)

    # ---- routes --------------------------------------------------------------------

    async def _page(
        self,
        content: bytes,
        media_type: str,
        headers: Mapping[str, str] | None,
        request: Request,
    ) -> Response:
        """The chat page, or its client, under the ``Host`` rule of the routes it calls
        (see ``_refuse_rebindable``): under a name that they refuse, its every call would
        be refused, so the page is refused too, with their error, which says what to do."""
        if self._token is None and self._authorize is None:
            try:
                _refuse_rebindable(request, self._trusted)
            except _RequestError as exc:
                return self._error_response(exc, request.scope)
        return self._answer(content, media_type, headers=headers)

    async def _health(self, request: Request) -> Response:
        """``GET /healthz``: 200 while the registry is open and its store answers a
        listing of one session within ``HEALTH_STORE_WAIT`` seconds, 503 otherwise
        (also while the app drains). It needs no token: it tells nothing but whether
        the server is ok; why not goes to the log, once each time it changes.

        Probes share the store's reads (see ``_store_problem``); whether the app is
        open is looked at by each probe, before and again after the store answered."""
        registry = self._registry
        problem = self._closed_problem()
        if not problem and registry is not None:
            problem = await self._store_problem(registry) or self._closed_problem()
        if problem and self._healthy:
            log.warning("health check: not ok: %s", problem)
        elif not problem and not self._healthy:
            log.info("health check: ok again")
        self._healthy = not problem
        if problem:
            return self._json({"status": "unavailable"}, 503)
        return self._json({"status": "ok"})

    def _closed_problem(self) -> str:
        """Why the app cannot serve now ("" if it can): its registry not open, or draining."""
        if self._registry is None or self._draining:
            return "the registry is not open (the server is starting or shutting down)"
        return ""

    async def _store_problem(self, registry: AnyRegistry) -> str:
        """What a read of the store finds wrong ("" for nothing), for ``GET /healthz``.

        One read at a time: a probe that comes while a read runs waits for that
        read's answer (for ``HEALTH_STORE_WAIT`` seconds at most, as long as the
        read itself may take) instead of reading the store too, so a burst of
        probes costs one read. An answer is never kept once its read ended: the
        first probe after it reads the store again. So a probe is told what a read
        found that ended after the probe came; never what one found that had ended
        before (a failure since then is seen by the next read). A read whose probe
        went away before the store answered gives the probes that waited on it no
        answer: they read again."""
        while True:
            check = self._store_check
            if check is None:
                return await self._check_store(registry)
            with anyio.move_on_after(HEALTH_STORE_WAIT):
                await check.done.wait()
            if not check.done.is_set():  # (the read is bounded so: no more than a safety net)
                return f"the store did not answer within {HEALTH_STORE_WAIT:g} s"
            if check.problem is not None:
                return check.problem

    async def _check_store(self, registry: AnyRegistry) -> str:
        """Read the store once for the health probes (see ``_store_problem``)."""
        check = self._store_check = _StoreCheck()
        try:
            try:
                with anyio.fail_after(HEALTH_STORE_WAIT):
                    await registry.sessions(limit=1)
                problem = ""
            except TimeoutError:
                problem = f"the store did not answer within {HEALTH_STORE_WAIT:g} s"
            except Exception as exc:  # (any failure is "not ok"; the log says which)
                problem = f"the store failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
            check.problem = problem
            return problem
        finally:  # (answered or not: the next probe reads again)
            if self._store_check is check:
                self._store_check = None
            check.done.set()

    async def _list(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, _name: str) -> Response:
            limit = _int_param(request, "limit", 100, low=1, high=1000)
            after = request.query_params.get("after")
            active_before = _time_param(request, "active_before")
            # newest activity first, read a page at a time (one more: is there a next?)
            infos = await registry.sessions(
                limit=limit + 1, after=after, active_before=active_before
            )
            page = infos[:limit]
            more = len(infos) > limit
            return self._json(
                {
                    "sessions": [_info_json(info) for info in page],
                    "next": page[-1].session_id if more and page else None,
                }
            )

        return await self._handle(request, "list", handler)

    async def _session(self, request: Request) -> Response:
        if request.method == "DELETE":
            return await self._delete(request)
        return await self._read(request)

    async def _read(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, name: str) -> Response:
            state = await registry.ref(name).state()
            return self._json(state_to_json(state))

        return await self._handle(request, "read", handler)

    async def _turn(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, name: str) -> Response:
            ref = await self._existing_ref(registry, name, request.scope)
            outcome = await ref.turn_outcome(_param(request, "turn_id"))
            return self._json(outcome_to_json(outcome))

        return await self._handle(request, "read", handler)

    async def _delete(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, name: str) -> Response:
            await registry.delete(name)
            return self._json({"deleted": name})

        return await self._handle(request, "delete", handler)

    async def _cancel(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, name: str) -> Response:
            turn_id = _optional_string(await self._body(request, _CANCEL_FIELDS), "turn_id")
            ref = await self._existing_ref(registry, name, request.scope)
            return self._json({"cancelled": await ref.cancel(turn_id)})

        return await self._handle(request, "cancel", handler)

    async def _message(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, name: str) -> Response:
            data = await self._body(request, _MESSAGE_FIELDS)
            text = _string(data, "text")
            key = _message_key(request, _optional_string(data, "idempotency_key"))
            agent = _optional_string(data, "agent")
            try:  # refused before the first message creates its session
                check_message(name, text, key)
            except (TypeError, ValueError) as exc:
                raise _RequestError(422, "InvalidRequest", str(exc)) from None
            # (the body read: a drain begun meanwhile refuses it, before it stores anything)
            first = self._first_message() if self._create_sessions else None
            try:
                ref = await self._ref_to_write(registry, name, agent)
                if _wants_events(request):
                    stream = functools.partial(self._turn_stream, registry, ref, text, key, first)
                    first = None  # (the stream ends it once its turn is submitted)
                    return cast(Response, EventStreamResponse(self._hooks, name, stream))
                turn = await self._submit(registry, ref, text, key)
            finally:
                if first is not None:
                    first.end()
            _name_turn(turn.id)
            return self._json(reply_to_json(await turn.reply()))

        return await self._handle(request, "send", handler)

    @asynccontextmanager
    async def _turn_stream(
        self,
        registry: AnyRegistry,
        ref: AnyRef,
        text: str,
        key: str | None,
        first: _FirstMessage | None = None,
    ) -> AsyncIterator[Stream]:
        async with contextlib.AsyncExitStack() as stack, contextlib.AsyncExitStack() as live:
            try:
                events: Any = await live.enter_async_context(ref.subscribe())
                turn = await self._submit(registry, ref, text, key)
            finally:
                if first is not None:
                    first.end()
            _name_turn(turn.id)
            if turn.replayed:  # an idempotency key that already completed: no new events
                reply = await turn.reply()
                yield Stream(None, prelude=[frame({"type": "reply", **reply_to_json(reply)})])
                return
            since, joined_at = joined(trio_turn(turn) if isinstance(turn, aio.Turn) else turn)
            if since is not None:
                # it joined its key's turn under way, which published events before
                # this subscription began (a review it waits on): from its start; the
                # live one, unread, would fill up and be cut off as lagged
                events = await _subscribe_from(stack, ref, since)
                await live.aclose()
            followed = _Followed(turn.id, key, began=False if since is None else None, turn=turn)
            yield Stream(
                events,
                select=self._turn_events(turn.id, joined_at, followed),
                side=functools.partial(_sse_outcome, turn, followed),
            )

    async def _review(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, name: str) -> Response:
            review_id = _param(request, "review_id")
            data = await self._body(request, _REVIEW_FIELDS)
            approve = data.get("approve")
            if not isinstance(approve, bool):
                raise _RequestError(
                    422, "InvalidRequest", "'approve' must be true or false (a JSON boolean)"
                )
            note = _optional_string(data, "note")
            if note is not None:
                try:  # (as a message's text is: before anything is looked up)
                    check_text(name, note, "note")
                except ValueError as exc:
                    raise _RequestError(422, "InvalidRequest", str(exc)) from None
            ref = await self._existing_ref(registry, name, request.scope)
            if not _wants_events(request):
                reply = await ref.review(review_id, approve, note)
                _name_turn(reply.turn_id)
                return self._json(reply_to_json(reply))
            state = await ref.state()
            review = next((r for r in state.reviews if r.id == review_id), None)
            if review is None:
                # resolved already, the same way (a retry): the turn's reply, as a retried
                # message's; no events come for it. Else its error (409, or 404)
                reply = await ref.review(review_id, approve, note)
                _name_turn(reply.turn_id)
                prelude = [frame({"type": "reply", **reply_to_json(reply)})]
                return cast(
                    Response,
                    EventStreamResponse(self._hooks, name, functools.partial(_told, prelude)),
                )
            _name_turn(review.turn_id)
            return cast(
                Response,
                EventStreamResponse(
                    self._hooks,
                    name,
                    functools.partial(
                        self._review_stream, ref, review, approve, note, state.event_seq
                    ),
                ),
            )

        return await self._handle(request, "review", handler)

    @asynccontextmanager
    async def _review_stream(
        self, ref: AnyRef, review: sa.ReviewRequest, approve: bool, note: str | None, after: int
    ) -> AsyncIterator[Stream]:
        # (from the seq at which the review was pending: a retry racing the first
        # resolution still gets the turn's events, which may have passed by now)
        async with contextlib.AsyncExitStack() as stack:
            events = await _subscribe_from(stack, ref, after)
            yield Stream(
                events,
                select=self._turn_events(review.turn_id or None),
                side=functools.partial(_outcome, ref.review, review.id, approve, note),
            )

    async def _events(self, request: Request) -> Response:
        async def handler(registry: AnyRegistry, name: str) -> Response:
            after = _after(request)
            ref = await self._existing_ref(registry, name, request.scope)
            # (the subscription opens before the response starts: an id beyond the
            # session's last event, or of events no longer available, is answered 410)
            return cast(
                Response,
                EventStreamResponse(
                    self._hooks, name, functools.partial(self._all_events, ref, after)
                ),
            )

        answer = await self._handle(request, "events", handler)
        if (
            not isinstance(answer, EventStreamResponse)
            and answer.status_code == 503
            and self._closed_problem()
            and _wants_events(request)
        ):
            # a browser's EventSource gives up for good on any answer but 200 (as one
            # reconnecting while the server drains gets): an empty stream that says when
            # to come back has it reconnect, with its Last-Event-ID, to the next server
            return Response(
                f"retry: {RETRY_MS}\n\n",
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        return answer

    async def _websocket(self, websocket: WebSocket) -> None:
        name = _param(websocket, "name")
        await websocket.accept()
        try:
            await self._admit(websocket, name, "websocket")
            registry = self._registry_now()
            after = _after(websocket)
            if self._create_sessions and not after:  # (a seq to resume after: not new)
                ref = await self._ref_to_write(
                    registry, name, websocket.query_params.get("agent"), socket=True
                )
            else:
                ref = await self._existing_ref(registry, name, websocket.scope)
            async with ref.subscribe(after) as events:
                await self._converse(registry, ref, websocket, events)
        except WebSocketDisconnect:
            return
        except WebSocketException as exc:  # authorize refused it so: as it says
            await _ws_close(websocket, None, exc.code, exc.reason)
        except Exception as exc:
            status, body = self._error_body(exc, websocket.scope, name)
            await _ws_close(websocket, {"type": "error", **body}, 4000 + status)

    async def _converse(
        self, registry: AnyRegistry, ref: AnyRef, websocket: WebSocket, events: Any
    ) -> None:
        # a send the client takes nothing of for two heartbeat intervals (a message larger
        # than WRITE_BYTES, which cannot be split, has that for each WRITE_BYTES it
        # carries, counted once the sends before it are done; a send begun later gives
        # it no more time) ends the socket and resets its connection (the client resumes
        # with ?after=); a client that reads slowly but steadily gets its messages
        writes = WriteGuard(
            websocket.scope, websocket.send, STALL_HEARTBEATS * self._hooks.heartbeat
        )

        async def say(data: dict[str, Any]) -> None:
            await writes.send({"type": "websocket.send", "text": dumps(data).decode()})

        async def failed(exc: Exception) -> None:
            _, body = self._error_body(exc, websocket.scope, ref.session_id)
            await say({"type": "error", **body})

        async def forward() -> None:
            code = 1000
            try:
                async for event in events:
                    await say(event_to_json(event))
            except sa.SubscriberLaggedError as exc:
                await failed(exc)  # reconnect with ?after=last_seq
            except sa.SessionActorsError as exc:
                # the session's events ended with an error (deleted: SessionNotFoundError):
                # told as a refused connection is, with its status in the close code
                status, body = self._error_body(exc, websocket.scope, ref.session_id)
                await say({"type": "error", **body})
                code = 4000 + status
            await writes.send({"type": "websocket.close", "code": code, "reason": ""})
            group.cancel_scope.cancel()

        async def wait_reply(wait: Callable[[], Awaitable[Any]]) -> None:
            try:
                await _outcome(wait)
            except Exception as exc:
                await failed(exc)

        async def wait_resolved(resolve: Callable[[], Awaitable[sa.Reply]]) -> None:
            try:
                reply = await resolve()
            except Exception as exc:
                await failed(exc)
            else:
                await say({"type": "reply", **reply_to_json(reply)})

        async def wait_turn(turn: sa.Turn | aio.Turn) -> None:
            try:
                data = await _replayed_late(turn)
            except Exception as exc:
                await failed(exc)
            else:
                if data is not None:
                    await say(data)

        async with anyio.create_task_group() as group:
            self._track(group.cancel_scope)
            try:
                group.start_soon(writes.guard, group.cancel_scope)
                group.start_soon(forward)
                while True:
                    # a client whose answers wait is read no further until it takes
                    # some: its frames stay in the network's buffers, not in tasks here
                    await writes.wait_room(WS_WRITES_PENDING)
                    try:
                        data = _loads(await _text_frame(websocket), "the frame")
                        if not isinstance(data, dict):
                            raise _RequestError(422, "InvalidRequest", "send a JSON object")
                        kind = data.get("type")
                        frame = _FRAMES.get(kind) if isinstance(kind, str) else None
                        if frame is None:
                            what = shown(kind) if isinstance(kind, str) else f"{kind!r:.60}"
                            raise _RequestError(
                                422,
                                "InvalidRequest",
                                f"unknown message type {what}; send 'message', 'cancel' or "
                                "'review'",
                            )
                        action, fields = frame
                        await self._authorized(websocket, ref.session_id, action)
                        _only(data, fields, f"a {kind!r} message")
                        _check_strings(data, f"the {kind!r} message")
                        if kind == "message":
                            text = _string(data, "text")
                            key = _optional_string(data, "idempotency_key")
                            turn = await self._submit(registry, ref, text, key)
                            again = turn.replayed
                            await say({"type": "submitted", "turn_id": turn.id, "replayed": again})
                            if again:  # no events come for it: its stored reply
                                group.start_soon(wait_resolved, turn.reply)
                            else:
                                group.start_soon(wait_turn, turn)
                        elif kind == "cancel":
                            turn_id = _optional_string(data, "turn_id")
                            cancelled = await ref.cancel(turn_id)
                            await say({"type": "cancelled", "cancelled": cancelled})
                        else:
                            review_id = _string(data, "review_id")
                            approve = data.get("approve")
                            if not isinstance(approve, bool):
                                raise _RequestError(
                                    422, "InvalidRequest", "'approve' must be true or false"
                                )
                            note = _optional_string(data, "note")
                            resolve = functools.partial(ref.review, review_id, approve, note)
                            pending = await ref.pending_reviews()
                            if any(r.id == review_id for r in pending):
                                group.start_soon(wait_reply, resolve)
                            else:  # resolved already: a retry gets its turn's reply (no
                                # events come for it), another decision its error
                                group.start_soon(wait_resolved, resolve)
                    except WebSocketDisconnect:
                        group.cancel_scope.cancel()
                        return
                    except WebSocketException as exc:  # authorize closes the socket so
                        close = {"code": exc.code, "reason": _close_reason(exc.reason)}
                        await writes.send({"type": "websocket.close", **close})
                        group.cancel_scope.cancel()
                        return
                    except RecursionError as exc:  # a frame nested too deep to decode
                        await failed(
                            _RequestError(
                                422, "InvalidJSON", f"the frame is not valid JSON ({exc})"
                            )
                        )
                    except (_RequestError, sa.SessionActorsError, json.JSONDecodeError) as exc:
                        await failed(exc)
                    except ValueError as exc:  # bad input, told as the HTTP routes tell it
                        await failed(_RequestError(422, "InvalidRequest", str(exc)))
            finally:
                self._untrack(group.cancel_scope)
        if writes.stalled:  # (its connection is reset: no closing frame)
            log.warning(
                "session %r: a WebSocket's client took less than 64 KB of a message in %s s; "
                "ended it",
                ref.session_id,
                writes.bound,
            )
        elif self._draining:
            await _ws_close(websocket, None, 1001)

    @asynccontextmanager
    async def _all_events(self, ref: AnyRef, after: int | None) -> AsyncIterator[Stream]:
        frames = self._frames

        def select(event: sa.Event) -> tuple[bytes | None, bool]:
            return frames(event), False

        async with ref.subscribe(after) as events:
            yield Stream(events, select=select)

    def _turn_events(
        self, turn_id: str | None, joined_at: int = 0, followed: _Followed | None = None
    ) -> Select:
        """One turn's events, up to its outcome or the review it then waits on
        (``joined_at``: see ``sessionactors._ref.joined``); with ``followed``, the turn
        its idempotency key runs again under a new id (its worker died mid-turn), as
        ``ref.stream`` follows it."""
        frames = self._frames
        if followed is None:
            followed = _Followed(turn_id)

        def select(event: sa.Event) -> tuple[bytes | None, bool]:
            event_turn = getattr(event, "turn_id", None)
            if (
                followed.key is not None
                and isinstance(event, sa.TurnStarted)
                and event.idempotency_key == followed.key
                and event_turn != followed.turn_id
            ):
                followed.turn_id = event_turn  # the key ran it again: a second TurnStarted
            elif (
                followed.began is False
                and followed.turn is not None
                and isinstance(event, sa.TurnStarted)
                and event_turn != followed.turn_id
                and event_turn == followed.turn.id
            ):
                # it never began where it was accepted: that worker closed and sent it on
                # to the session's next worker, which runs it under this id
                followed.turn_id = event_turn
            if followed.turn_id is not None and event_turn != followed.turn_id:
                return None, False
            if taken_back(event, joined_at):  # (the turn resumed after a crash)
                return None, False
            if isinstance(event, sa.TurnStarted):
                followed.began = True
            elif followed.began is False and isinstance(event, sa.TurnFailed) and not event.lost:
                # refused before it began: the stream ends with the refusal that its
                # caller gets (the side's error frame: its status, the gateway's words)
                return None, False
            return frames(event), isinstance(event, _OUTCOMES)

        return select


#: The attribute that names a turn on a span (as the turn's own span has it).
_TURN_ID: Final = "sessionactors.turn.id"


def _request_line(scope: Mapping[str, Any]) -> str:
    """The request of ``scope`` as a log line names it: its method and path (one line,
    no control character of the client's)."""
    method = scope.get("method") or str(scope.get("type", "")).upper()
    return terminal_safe(f"{method} {scope.get('path', '')}", one_line=True)


def _of_session(error: BaseException) -> str:
    """What names the session of an error about one in a log line (" of session 'NAME'");
    "" for any other error."""
    name = getattr(error, "session_id", None)
    return f" of session {name!r}" if isinstance(name, str) else ""


def _name_turn(turn_id: str) -> None:
    """Put ``turn_id`` on the request's span, if OpenTelemetry is in use and that span
    records: a turn is a trace of its own (it runs in its session's actor), and this
    is what ties a request to it. Nothing is imported for it: if nothing imported
    OpenTelemetry's API, no span can be current."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None or not turn_id:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(_TURN_ID, turn_id)


async def _subscribe_from(stack: contextlib.AsyncExitStack, ref: AnyRef, after: int) -> Any:
    """The session's events after ``after``, or from the oldest still available."""
    while True:
        try:
            return await stack.enter_async_context(ref.subscribe(after))
        except sa.EventsExpiredError as exc:
            after = exc.oldest_seq - 1


@asynccontextmanager
async def _told(prelude: list[bytes]) -> AsyncIterator[Stream]:
    """A stream of ``prelude`` alone."""
    yield Stream(None, prelude=prelude)


async def _outcome(wait: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Wait for a turn's reply; its failure or cancellation is told by its events."""
    with contextlib.suppress(sa.TurnFailedError, sa.TurnCancelledError):
        await wait(*args)


async def _replayed_late(turn: sa.Turn | aio.Turn) -> dict[str, Any] | None:
    """Wait for the reply of a turn that was not replayed when submitted (see
    ``_outcome``); its "reply" frame if it turned out to be (submitted to a session
    still waking, which had yet to look its idempotency key up): no events come for it."""
    with contextlib.suppress(sa.TurnFailedError, sa.TurnCancelledError):
        reply = await turn.reply()
        if turn.replayed:
            return {"type": "reply", **reply_to_json(reply)}
    return None


@attrs.define
class _Followed:
    """The turn an event stream of one turn follows: the one submitted, then the one its
    idempotency key ran again after its worker died (see ``_turn_events``)."""

    turn_id: str | None
    key: str | None = None
    #: Whether its TurnStarted came (None: the stream joined it under way): False until
    #: then for a stream that subscribed before submitting it (see ``_turn_events``).
    began: bool | None = None
    #: The turn submitted, whose ``id`` names the turn it runs as where it was sent on.
    turn: sa.Turn | aio.Turn | None = None


async def _sse_outcome(turn: sa.Turn | aio.Turn, followed: _Followed) -> bytes | None:
    """The frame that ends a turn's event stream when its events will not: the reply of
    a turn whose key had already completed (no events come for it), or of a turn that
    ran under another id than the one the stream follows (sent on to the session's next
    worker); the error of such a turn that failed. None: its events end the stream."""
    try:
        reply = await turn.reply()
    except (sa.TurnFailedError, sa.TurnCancelledError):
        if turn.id != followed.turn_id:
            raise  # (ends the stream with its error frame)
        return None
    if turn.replayed or turn.id != followed.turn_id:
        return frame({"type": "reply", **reply_to_json(reply)})
    return None


async def _ws_close(
    websocket: WebSocket, frame: dict[str, Any] | None, code: int, reason: str = ""
) -> None:
    try:
        if frame is not None:
            await websocket.send_text(dumps(frame).decode())
        await websocket.close(code, _close_reason(reason))
    except (RuntimeError, WebSocketDisconnect, OSError):  # already closed by the client
        pass


#: How many of a WebSocket's writes (events and answers) may wait for its client before
#: its next frame is read.
WS_WRITES_PENDING: Final = 16


#: The longest reason a WebSocket's close frame carries, in UTF-8 bytes (RFC 6455, 5.5).
_CLOSE_REASON_BYTES: Final = 123


def _close_reason(reason: str | None) -> str:
    """``reason`` cut to what a close frame carries (a longer one the servers refuse)."""
    data = (reason or "").encode(errors="replace")
    return data[:_CLOSE_REASON_BYTES].decode(errors="ignore")


#: Stands for a '/' inside one segment of a path (``%2F``): no session name holds it.
_SLASH: Final = "\x00"
_SLASHED: Final = "sessionactors.slashes"


def _slashes_in_segments(scope: Any) -> Any:
    """``scope`` with ``%2F`` kept apart from the path's '/'s, for the routes: servers
    decode the path, and a session name with '/' (which the naming rules allow) would
    become more segments and no route. ``_param`` reads it back."""
    raw = scope.get("raw_path") if scope["type"] in ("http", "websocket") else None
    if not raw or b"%2f" not in raw.lower():
        return scope
    try:
        segments = [unquote(s, errors="strict") for s in raw.split(b"?")[0].decode().split("/")]
    except UnicodeDecodeError:
        return scope
    if any(_SLASH in segment for segment in segments):
        return scope  # (a name with a NUL: refused as it is)
    path = "/".join(segment.replace("/", _SLASH) for segment in segments)
    served: str = scope["path"]  # (under a mount, perhaps the part below it)
    if not path.replace(_SLASH, "/").endswith(served):
        return scope
    return {**scope, "path": path[len(path) - len(served) :], _SLASHED: True}


def _refuse_bent_path(connection: HTTPConnection) -> None:
    """Refuse (raise _RequestError) a path whose %-escapes are not UTF-8: servers decode
    them leniently (``a%FF`` would be ``a\ufffd``, the name of another session)."""
    raw = connection.scope.get("raw_path")
    if raw:
        try:
            unquote_to_bytes(raw.split(b"?")[0]).decode()
        except UnicodeDecodeError:
            raise _RequestError(
                422,
                "InvalidRequest",
                f"the path {shown(raw.decode('latin-1'))} is not UTF-8 once its %-escapes "
                "are decoded; percent-encode the UTF-8 bytes of the name",
            ) from None


def _param(connection: HTTPConnection, key: str, default: str = "") -> str:
    """A path parameter (a session name, a review id), '/'s in it included."""
    value: str = connection.path_params.get(key, default)
    return value.replace(_SLASH, "/") if connection.scope.get(_SLASHED) else value


def _info_json(info: sa.SessionInfo) -> dict[str, Any]:
    data: dict[str, Any] = to_json(info)
    data["metadata"] = metadata_json(info.metadata)
    return data


def _bearer(request: HTTPConnection) -> str | None:
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, value = header.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    return request.query_params.get("access_token")


#: Content types a browser sends across origins without asking first (no preflight).
_SIMPLE_TYPES: Final = frozenset(
    {"", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}
)


async def _send_with_origin(send: Any, origin: str | None, message: Any) -> None:
    """``send`` of an HTTP response to a gateway with CORS origins: it varies on
    ``Origin``, and names ``origin``, one of them, whose page may read it."""
    if message["type"] == "http.response.start":
        message = {**message, "headers": list(message.get("headers", ()))}
        _cors.with_origin(message, origin)
    await send(message)


#: What an HTTP header's name may hold (RFC 9110's token).
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _header_names(given: Iterable[str]) -> tuple[str, ...]:
    """``cors_headers``, checked, in lower case (as preflights name them)."""
    names: list[str] = []
    for name in [given] if isinstance(given, str) else given:
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise ValueError(
                f"cors_headers: {name!r} is not the name of an HTTP header; give names "
                "such as 'X-API-Key'"
            )
        if name.lower() not in names and name.lower() not in _cors.ALLOWED_HEADERS:
            names.append(name.lower())
    return tuple(names)


def _origins(given: Iterable[str], what: str) -> frozenset[str]:
    """``trusted_origins`` or ``cors_origins`` (``what``), checked, as browsers write
    them in ``Origin``."""
    origins = set()
    for origin in [given] if isinstance(given, str) else given:
        written = _origin(origin)
        if written is None:
            raise ValueError(
                f"{what} origin {origin!r} is not an origin: give its scheme, host and "
                "port (if not the default) as browsers send them in Origin, such as "
                "'https://app.example.com' or 'http://localhost:5173'"
            )
        origins.add(written)
    return frozenset(origins)


def _origin(origin: object) -> str | None:
    """``origin`` as browsers write it in ``Origin`` (lower case, without the scheme's
    default port), or None if it is not an http or https origin."""
    if not isinstance(origin, str):
        return None
    parts = urlsplit(origin.strip().lower())
    try:
        port = parts.port
    except ValueError:  # (not a number, or out of range)
        return None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        return None
    netloc = parts.netloc
    if port == {"http": 80, "https": 443}[parts.scheme]:
        netloc = netloc[: netloc.rfind(":")]
    return f"{parts.scheme}://{netloc}"


def _refuse_rebindable(request: HTTPConnection, trusted: frozenset[str]) -> None:
    """Refuse (raise _RequestError) a request to a gateway with neither token nor
    ``authorize`` whose ``Host`` is a name that DNS rebinding could point here: a page of
    that name is, to the browser, of the same origin as this server, so the Origin check
    lets it through. IP addresses, names of one label (``localhost``, ``testserver``,
    a container's name: no public DNS serves them), subdomains of ``localhost`` and the
    hosts of ``trusted`` origins cannot be rebound."""
    host = request.headers.get("host")
    if host is None:  # (no browser sends a request without one)
        return
    name = urlsplit(f"//{host}").hostname or ""
    if "." not in name or name.endswith(".localhost") or _is_address(name):
        return
    if any(urlsplit(origin).hostname == name for origin in trusted):
        return
    raise _RequestError(
        403,
        "UnknownHost",
        f"this server has no token and no authorize, so it answers only its addresses, "
        f"localhost and its trusted origins, not the name {shown(host)}: a page of any "
        "site could reach it under such a name (DNS rebinding) and act on its sessions. "
        "Name its origin in create_app(trusted_origins=[...]) (serve --trusted-origin), "
        "or give the server a token (create_app(token=...)) or an authorize",
    )


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _refuse_forgeable(request: HTTPConnection, trusted: frozenset[str]) -> None:
    """Refuse (raise _RequestError) what a page of another site could make a browser
    send without the server's token (cross-site request forgery): a WebSocket (browsers
    apply no CORS to them), or a POST a browser sends with no preflight (no
    Authorization header, a form or text/plain body). A JSON request from another origin
    is preflighted: CORS (none unless the app adds it) decides. Non-browser clients send
    no Origin; the pages of ``trusted`` origins are not another site."""
    origin = request.headers.get("origin")
    if origin is None or urlsplit(origin).netloc.lower() == request.headers.get("host", "").lower():
        return
    if origin.lower() in trusted:
        return
    if request.scope["type"] == "websocket":
        what = "a WebSocket opened by a page of another site"
    else:
        if request.scope["method"] in ("GET", "HEAD") or "authorization" in request.headers:
            return
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type not in _SIMPLE_TYPES:
            return
        what = "a form or text/plain request from a page of another site"
    raise _RequestError(
        403,
        "CrossOrigin",
        f"{what} (Origin: {shown(origin)}) is refused: any site could send it with the "
        "user's browser. Serve the page from this server, or name its origin in "
        "create_app(trusted_origins=[...]) (serve --trusted-origin); or give the server "
        "a token (create_app(token=...)) that the page sends, and send JSON "
        "(Content-Type: application/json)",
    )


def _auth_header(status: int) -> dict[str, str] | None:
    return {"WWW-Authenticate": 'Bearer realm="sessionactors"'} if status == 401 else None


def _too_large(limit: int) -> _RequestError:
    return _RequestError(413, "RequestTooLarge", f"the request body is over {limit:,} bytes")


def _wants_events(request: Request) -> bool:
    """Whether the request's Accept names an event stream (in any case; not with q=0)."""
    for media_range in request.headers.get("accept", "").split(","):
        kind, *parameters = media_range.split(";")
        if kind.strip().lower() == "text/event-stream":
            return not any(_refused(parameter) for parameter in parameters)
    return False


def _refused(parameter: str) -> bool:
    """Whether a media range's ``parameter`` is a quality of 0 (``q=0``, ``q=0.000``)."""
    name, _, value = parameter.partition("=")
    if name.strip().lower() != "q":
        return False
    try:
        return float(value) == 0
    except ValueError:  # (not a quality: the range is taken as it is)
        return False


#: The fields of each JSON body the gateway reads, and of each WebSocket frame.
_MESSAGE_FIELDS: Final = ("text", "idempotency_key", "agent")
_CANCEL_FIELDS: Final = ("turn_id",)
_REVIEW_FIELDS: Final = ("approve", "note")
_FRAMES: Final[dict[str, tuple[Action, tuple[str, ...]]]] = {  # (action, fields)
    "message": ("send", ("type", "text", "idempotency_key")),
    "cancel": ("cancel", ("type", "turn_id")),
    "review": ("review", ("type", "review_id", "approve", "note")),
}

#: The header that may carry a message's idempotency key instead of its JSON's
#: ``"idempotency_key"`` (the IETF draft "The Idempotency-Key HTTP Header Field").
_KEY_HEADER: Final = "idempotency-key"


def _message_key(request: Request, body_key: str | None) -> str | None:
    """A message's idempotency key: its ``Idempotency-Key`` header's, its body's
    ``"idempotency_key"``, or the one key both give. Refused (raise _RequestError, 400)
    if they give different keys, or if the header gives none (see ``_header_key``):
    the message is not sent with a key it was not meant to have."""
    given = request.headers.getlist(_KEY_HEADER)
    if not given:
        return body_key
    keys = {_header_key(value) for value in given}
    if len(keys) > 1:
        named = ", ".join(shown(key) for key in sorted(keys)[:_UNKNOWN_SHOWN])
        raise _RequestError(
            400,
            "IdempotencyKeyConflict",
            f"the request's Idempotency-Key headers give {len(keys)} keys ({named}); "
            "send one key; nothing ran",
        )
    [key] = keys
    if body_key is not None and body_key != key:
        raise _RequestError(
            400,
            "IdempotencyKeyConflict",
            f"the Idempotency-Key header gives the key {shown(key)} and the body's "
            f'"idempotency_key" the key {shown(body_key)}; send the key in one of them, '
            "or the same key in both; nothing ran",
        )
    return key


def _header_key(value: str) -> str:
    """The key that an ``Idempotency-Key`` header's ``value`` gives: a structured-field
    string (RFC 8941) as the draft writes it, ``"8e03978e"``, with its
    ``\\"`` and ``\\\\`` escapes (parameters after it are ignored); or, unquoted, the
    value itself (``8e03978e``, as many clients send it), its bytes read as UTF-8 (as
    the body's key is written). Refused (raise _RequestError, 400): a quoted value that
    is not such a string, an unquoted one that is not UTF-8."""
    value = value.strip(" \t")
    if not value.startswith('"'):
        try:  # (the server read the header's bytes as Latin-1)
            return value.encode("latin-1").decode("utf-8")
        except UnicodeError:
            raise _RequestError(
                400,
                "InvalidRequest",
                "the Idempotency-Key header is not UTF-8 text; send the key as UTF-8 "
                '(or in the body\'s "idempotency_key"); nothing ran',
            ) from None
    chars: list[str] = []
    at = 1
    while at < len(value):
        char = value[at]
        if char == '"':
            rest = value[at + 1 :]
            if not rest or rest.startswith(";"):
                return "".join(chars)
            break
        if char == "\\":
            at += 1
            if at == len(value) or value[at] not in '"\\':
                break
            char = value[at]
        elif not " " <= char <= "~":
            break
        chars.append(char)
        at += 1
    raise _RequestError(
        400,
        "InvalidRequest",
        f"the Idempotency-Key header {shown(value)} is not a key: send it as a string "
        '("KEY": printable ASCII, with \\" and \\\\ for a quote and a backslash), or '
        "unquoted, as it is",
    )


#: How many unknown fields a refusal names.
_UNKNOWN_SHOWN: Final = 5


def _only(data: dict[str, Any], fields: tuple[str, ...], what: str) -> None:
    """Refuse ``data`` (raise _RequestError) if it has a field not in ``fields``: a
    misspelled ``idempotency_key``, ignored, would run a retried turn twice."""
    unknown = [key for key in data if key not in fields]
    if not unknown:
        return
    named = ", ".join(shown(key) for key in unknown[:_UNKNOWN_SHOWN])
    if len(unknown) > _UNKNOWN_SHOWN:
        named += f" and {len(unknown) - _UNKNOWN_SHOWN:,} more"
    plural = "s" if len(unknown) > 1 else ""
    accepted = ", ".join(repr(field) for field in fields)
    raise _RequestError(
        422,
        "InvalidRequest",
        f"{what} has the unknown field{plural} {named}; it takes only {accepted} "
        "(check the spelling: an unknown field is refused, not ignored)",
    )


def _loads(text: str | bytes | bytearray, what: str) -> Any:
    """JSON ``text`` (``what``: the request body, a frame), refused (_RequestError) if it
    holds a number too long to read."""

    def number(digits: str) -> int:
        try:
            return int(digits)
        except ValueError:  # over sys.get_int_max_str_digits()
            raise _RequestError(
                422,
                "InvalidJSON",
                f"{what} holds a number of {len(digits.lstrip('-')):,} digits, over the "
                f"{sys.get_int_max_str_digits():,} this server reads; send a shorter one, "
                "or send it as a string",
            ) from None

    if _values(text) > MAX_JSON_VALUES:
        raise _RequestError(
            422,
            "InvalidJSON",
            f"{what} holds over {MAX_JSON_VALUES:,} JSON values, objects and arrays, more "
            "than any request needs; send fewer",
        )
    return json.loads(text, parse_int=number)


#: The most values (objects, arrays and the items in them) a request body or frame may
#: hold: far more than any request needs (a session's metadata, at most 64 KiB, holds
#: some 33,000), far fewer than a body of small ones swells to as it is parsed (a few
#: MiB of ``[{},{},...]`` are millions of dicts, of ``[1.5,1.5,...]`` a second of
#: parsing).
MAX_JSON_VALUES: Final = 100_000

#: A JSON string, its brackets and commas text; or the rest of a string that does not
#: end (the closing quote optional: one try reaches the end, not one per escape).
_JSON_STRING: Final = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_JSON_BYTES_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)


def _values(text: str | bytes | bytearray) -> int:
    """About how many values JSON ``text`` holds: its brackets and commas outside strings
    (counted apart from strings only when all of them are too many)."""
    pattern: Any = _JSON_STRING
    marks: tuple[Any, ...] = ("{", "[", ",")
    if not isinstance(text, str):
        pattern, marks = _JSON_BYTES_STRING, (b"{", b"[", b",")
    count = sum(text.count(mark) for mark in marks)
    if count > MAX_JSON_VALUES:
        bare = pattern.sub(marks[0][:0], text)  # ("" or b"")
        count = sum(bare.count(mark) for mark in marks)
    return count


def _check_strings(data: dict[str, Any], what: str) -> None:
    """Refuse (raise _RequestError) a string of ``data`` with a lone surrogate (a
    ``\\ud800`` escape without its pair, which JSON decoders let through): no store
    can hold it."""
    for key, value in data.items():
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError as exc:
                escape = f"\\u{ord(value[exc.start]):04x}"
                raise _RequestError(
                    422,
                    "InvalidRequest",
                    f"{key!r} in {what} holds a lone surrogate {escape} (at index "
                    f"{exc.start}), which is not text; escape a character beyond U+FFFF as "
                    "its pair of surrogates, or send it as UTF-8",
                ) from None


def _name_shown(name: str) -> str:
    """A session name as a gateway error repeats it: whole if a name could be that
    long, else its start and its length (a client may send a path of any length)."""
    return repr(name) if as_session_id(name) is not None else shown(name)


def _string(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise _RequestError(422, "InvalidRequest", f"{key!r} must be a string, got {got}")
    return value


def _optional_string(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise _RequestError(
            422, "InvalidRequest", f"{key!r} must be a string or null, not {type(value).__name__}"
        )
    return value


def _int_param(request: Request, key: str, default: int, *, low: int, high: int) -> int:
    raw = request.query_params.get(key)
    if raw is None:
        return default
    value = _digits(raw, low - 1)
    if not low <= value <= high:
        raise _RequestError(
            422,
            "InvalidRequest",
            f"?{key}= must be an integer from {low} to {high}, not {shown(raw)}",
        )
    return value


def _time_param(request: Request, key: str) -> datetime.datetime | None:
    """The query parameter ``key`` as an ISO 8601 time with an offset, if given."""
    raw = request.query_params.get(key)
    if raw is None:
        return None
    try:
        when = datetime.datetime.fromisoformat(raw) if len(raw) <= 64 else None
    except ValueError:
        when = None
    if when is None or when.utcoffset() is None:
        raise _RequestError(
            422,
            "InvalidRequest",
            f"?{key}= must be an ISO 8601 time with its offset (2025-01-31T00:00:00Z, or "
            f"+00:00 written %2B00:00 in a URL), not {shown(raw)}",
        )
    return when


async def _text_frame(websocket: WebSocket) -> str:
    """The next frame of ``websocket``, which must be text (422 for a binary one)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    text = message.get("text")
    if text is None:
        raise _RequestError(
            422, "InvalidRequest", "a binary frame: send each message as a text frame of JSON"
        )
    return str(text)


#: The largest number ``_digits`` reads (20 digits).
_LAST_DIGITS: Final = 10**20 - 1


def _digits(raw: str, otherwise: int) -> int:
    """``raw`` read as a number written in ASCII digits only (``int`` would also take
    ``1_0``, `` 5 ``, ``+1`` and other scripts' digits), else ``otherwise``."""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 20 else otherwise


def _after(request: HTTPConnection) -> int | None:
    """The seq to resume after: the Last-Event-ID header, else ``?after=``."""
    raw = request.headers.get("last-event-id")
    source = "Last-Event-ID"
    if raw is None or not raw.strip():
        raw = request.query_params.get("after")
        source = "?after="
    if raw is None or raw == "":
        return None
    value = _digits(raw.lstrip("0") or "0", -1)
    if value < 0 and raw.isascii() and raw.isdigit():  # (past every seq: told so, 410)
        value = _LAST_DIGITS
    if value < 0:
        raise _RequestError(
            422,
            "InvalidRequest",
            f"{source} must be an event seq (an integer >= 0), not {shown(raw)}",
        )
    return value
