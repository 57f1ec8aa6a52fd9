"""CORS for the pages of the origins an app names (``create_app(cors_origins=...)``).

A page of such an origin may call the gateway from the browser with the user's
credentials: its preflights are answered, and every answer to it names its origin
(``Access-Control-Allow-Origin``, never ``*``) so that the page can read it. A page of
any other origin is answered as without CORS: its preflights are refused and it reads
nothing. Every answer says ``Vary: Origin``, since what it says depends on the origin.
"""

from __future__ import annotations

from typing import Any, Final

from starlette.datastructures import Headers, MutableHeaders

from .._errors import shown

__all__ = [
    "ALLOWED_HEADERS",
    "ALLOWED_METHODS",
    "MAX_AGE",
    "is_preflight",
    "preflight",
    "preflight_vary",
    "refusal",
    "with_origin",
]

#: What a page may send besides the headers every page may (``Accept``,
#: ``Content-Type`` and the other CORS-safelisted ones): the token, a message's
#: idempotency key, the seq an event stream resumes after, and the trace context of a
#: page that OpenTelemetry instruments.
ALLOWED_HEADERS: Final = (
    "accept",
    "accept-language",
    "authorization",
    "content-language",
    "content-type",
    "idempotency-key",
    "last-event-id",
    "traceparent",
    "tracestate",
)

#: The gateway's methods.
ALLOWED_METHODS: Final = ("GET", "POST", "DELETE")

#: How long a browser may keep a preflight's answer, in seconds.
MAX_AGE: Final = 600

_PREFLIGHT_VARY: Final = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"


def is_preflight(method: str, headers: Headers) -> bool:
    """Whether an HTTP request (its ``method`` and ``headers``) is a browser's CORS
    preflight."""
    asks = "access-control-request-method" in headers
    return method == "OPTIONS" and asks and "origin" in headers


def refusal(headers: Headers, origins: frozenset[str], extra: tuple[str, ...] = ()) -> str | None:
    """Why a preflight is refused, or None if it is allowed (refused: an origin not
    in ``origins``, a method that is not the gateway's, a header that neither it nor
    the app's ``authorize`` reads: ``extra``, lower case)."""
    origin = headers["origin"]
    if origin not in origins:
        return (
            f"a preflight from the page of {shown(origin)} is refused: this server answers "
            "CORS only for the origins it names (create_app(cors_origins=[...]), serve "
            "--cors-origin)"
        )
    method = headers["access-control-request-method"]
    if method not in ALLOWED_METHODS:
        return (
            f"a preflight for the method {shown(method)} is refused: the routes take "
            f"{', '.join(ALLOWED_METHODS)}"
        )
    requested = headers.get("access-control-request-headers", "")
    for header in (name.strip().lower() for name in requested.split(",")):
        if header and header not in ALLOWED_HEADERS and header not in extra:
            return (
                f"a preflight for the header {shown(header)} is refused: this server reads "
                f"none such; a page may send {', '.join(ALLOWED_HEADERS + extra)} (one "
                "that an authorize hook reads goes in create_app(cors_headers=[...]))"
            )
    return None


def preflight(headers: Headers, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The headers that allow a preflight (of request ``headers``) that is allowed
    (``extra``: the headers the app's ``authorize`` reads, allowed too)."""
    allowed = {
        "Access-Control-Allow-Origin": headers["origin"],
        "Access-Control-Allow-Credentials": "true",
        "Access-Control-Allow-Methods": ", ".join(ALLOWED_METHODS),
        "Access-Control-Allow-Headers": ", ".join(ALLOWED_HEADERS + extra),
        "Access-Control-Max-Age": str(MAX_AGE),
        "Vary": _PREFLIGHT_VARY,
    }
    if "access-control-request-private-network" in headers:  # (a page of a public site)
        allowed["Access-Control-Allow-Private-Network"] = "true"
    return allowed


def preflight_vary() -> dict[str, str]:
    """The headers of a refused preflight's answer."""
    return {"Vary": _PREFLIGHT_VARY}


def with_origin(message: dict[str, Any], origin: str | None) -> None:
    """Add to a response's start ``message`` that it varies on ``Origin``, and, for a
    request from an origin allowed (``origin``), that its page may read it (and its
    ``Retry-After``)."""
    message.setdefault("headers", [])
    headers = MutableHeaders(scope=message)
    headers.add_vary_header("Origin")
    if origin is not None:
        headers["Access-Control-Allow-Origin"] = origin
        headers["Access-Control-Allow-Credentials"] = "true"
        headers["Access-Control-Expose-Headers"] = "Retry-After"  # (of a 429 or a 503)
