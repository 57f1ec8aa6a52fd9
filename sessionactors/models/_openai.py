"""A model adapter for OpenAI-compatible chat completion servers.

:class:`OpenAIChatModel` streams ``POST {base_url}/chat/completions`` with
``stream: true`` and turns the server-sent events into
:class:`~sessionactors.TextChunk` and :class:`~sessionactors.ToolCallChunk`
values, exactly as they arrive, and the token counts the server reports
(it asks for them with ``stream_options.include_usage``) into one
:class:`~sessionactors.UsageChunk` at the end: usage is a running total, so
a server that sends it with every chunk is counted once, by its last. An
answer that the server cut short (``finish_reason`` ``"length"``,
``"content_filter"``, or any but the natural ends: ``"stop"``, ``"tool_calls"``,
``"function_call"``, ``"eos_token"``, ``"stop_sequence"``, ``"end_turn"``) ends with a
:class:`~sessionactors.FinishChunk` of that reason. It works with OpenAI
itself and with the servers that copy its API (vLLM, llama.cpp, Ollama, LM
Studio, ...).

Transient failures (HTTP 429 and 5xx, connection errors) are retried with
exponential backoff, but only until the first chunk has been yielded: after
that a failure is raised, since the consumer has already seen part of the
answer. Everything else becomes a :class:`~sessionactors.ModelError`.

The adapter is written for anyio, so it runs under trio and under asyncio:
under :func:`sessionactors.aio.open_registry` it runs on the host's asyncio
loop, as the app's own models do, and a ``client`` the asyncio app uses too
can be shared with it.

This module needs the ``openai`` extra (httpx, httpx-sse and anyio).
"""

import contextlib
import datetime
import email.utils
import html
import json
import random
import re
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, NoReturn, cast

import anyio
import attrs
import httpx
from httpx_sse import EventSource

from .._errors import ModelError
from .._model import (
    FinishChunk,
    ModelChunk,
    ModelRequest,
    TextChunk,
    ToolCallChunk,
    ToolSpec,
    UsageChunk,
)
from .._records import Message, Role

__all__ = ["OpenAIChatModel"]

#: The HTTP statuses worth asking again for.
_RETRYABLE_STATUS = frozenset({429}) | frozenset(range(500, 600))

#: Transport errors that may be gone on the next attempt.
_RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)

#: httpx's own timeouts for an owned client: generous to connect, none to read
#: (a model may think for minutes between two chunks; the caller owns time
#: with ``trio.fail_after``).
_TIMEOUT = httpx.Timeout(connect=60.0, read=None, write=60.0, pool=60.0)

#: The finish reasons of an answer that ended of its own accord (OpenAI's, its older
#: ``"function_call"``, and those of servers that copy its API: TGI's ``"eos_token"``
#: and ``"stop_sequence"``, ``"end_turn"``); any other (``"length"``,
#: ``"content_filter"``, ...) comes as a FinishChunk.
_NATURAL_ENDS = frozenset(
    {"stop", "tool_calls", "function_call", "eos_token", "stop_sequence", "end_turn"}
)

#: How much of an error response is read to find the server's message.
_MAX_ERROR_BODY = 64 * 1024

#: The most characters one event of a stream may take, up to the blank line that
#: ends it: room for a whole answer (MAX_ANSWER_CHARS), JSON-escaped, and to spare. A
#: server sending more without ending the event is broken: fail rather than buffer it.
_MAX_EVENT_CHARS = 16 * 1024 * 1024

#: How long a stream is read on after ``data: [DONE]`` for the end of its body (see
#: ``_drain``).
_DRAIN_SECONDS = 1.0

#: The title of an HTML error page (a proxy's, a CDN's), where it says what happened.
_HTML_TITLE = re.compile(r"<title[^>]*>([^<]{1,300})</title>", re.IGNORECASE)

#: How much of a server's text is quoted in an error message.
_MAX_QUOTE = 300


def _quote(text: str) -> str:
    text = text.strip()
    if len(text) > _MAX_QUOTE:
        text = text[:_MAX_QUOTE] + "..."
    return repr(text)


def _check_url(instance: object, attribute: "attrs.Attribute[str]", value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"base_url must be a str such as 'http://127.0.0.1:8000/v1', not {type(value).__name__}"
        )
    if value != value.strip():
        raise ValueError(
            f"base_url {value!r:.100} has a space or a newline at its start or end; "
            "remove it (was it read from a file or an environment variable?)"
        )
    if not value.startswith(("http://", "https://")):
        raise ValueError(
            f"base_url must start with http:// or https://, got {value!r}; "
            "for example 'http://127.0.0.1:8000/v1'"
        )
    try:
        url = httpx.URL(value)
        port = url.port
    except httpx.InvalidURL as exc:
        raise ValueError(
            f"base_url {value!r:.100} is not a URL httpx can send to ({exc}); "
            "check it for spaces, newlines or a stray character"
        ) from None
    if not url.host:
        raise ValueError(
            f"base_url {value!r:.100} names no host; for example 'http://127.0.0.1:8000/v1'"
        )
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"base_url {value!r:.100} has port {port}, outside 1..65535")


#: What an ``api_key`` may hold: visible ASCII, as a Bearer token (RFC 6750) does.
_API_KEY = re.compile(r"[\x21-\x7e]+")
#: An HTTP header name (RFC 9110 token) and what its value may hold (visible ASCII,
#: with spaces and tabs inside), as httpx can send them.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"([\x21-\x7e]([\x20-\x7e\t]*[\x21-\x7e])?)?")


def _check_api_key(
    instance: object, attribute: "attrs.Attribute[str | None]", value: object
) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"api_key must be a str or None, got {type(value).__name__}")
    if not value:
        raise ValueError("api_key is empty, which no request can carry; give None to send no key")
    if not _API_KEY.fullmatch(value):
        raise ValueError(
            "api_key holds a space, a newline or a character that is not ASCII, which no "
            "request can carry; check where it was read from (a trailing newline?)"
        )


def _check_finite(instance: object, attribute: "attrs.Attribute[float]", value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a number, got {type(value).__name__}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


def _check_model_name(instance: object, attribute: "attrs.Attribute[str]", value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"model must be the model name the server knows (a str such as 'gpt-4o-mini'), "
            f"not {type(value).__name__}"
        )
    if not value:
        raise ValueError(
            f"model must be the model name the server knows (a non-empty str, such as "
            f"'gpt-4o-mini'), got {value!r:.60}"
        )


def _check_retries(instance: object, attribute: "attrs.Attribute[int]", value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"max_retries must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"max_retries must be at least 0, got {value}")


def _check_optional(kind: type, what: str) -> Any:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{attribute.name} must be {what} or None, got {type(value).__name__}")

    return check


def _check_headers(
    instance: object, attribute: "attrs.Attribute[Mapping[str, str] | None]", value: object
) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise TypeError(
            "headers must be a mapping of header names to str values, such as "
            f"{{'X-Team': 'support'}}, got {value!r:.60}"
        )
    for name, text in value.items():
        if not _HEADER_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(text):
            raise ValueError(
                f"headers cannot send {name!r:.60}: {text!r:.60}: a header name is letters, "
                "digits and -, a value is ASCII with no newline and no space at either end"
            )


def _json_default(value: object) -> object:
    # Tool schemas are Mappings and may hold tuples; JSON wants dicts and lists.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


@attrs.define(eq=False)
class OpenAIChatModel:
    """A :class:`~sessionactors.Model` that streams from an OpenAI-compatible server.

    ``base_url`` is the API root, usually ending in ``/v1``
    (``http://127.0.0.1:8000/v1``); ``model`` the model name the server knows;
    ``api_key`` is sent as a Bearer token when given.

    A request that fails with HTTP 429 or 5xx, or cannot reach the server, is
    tried up to ``max_retries`` more times before the first chunk is yielded,
    waiting ``backoff * 2**attempt`` seconds (plus a little jitter, at most
    ``max_backoff``); a ``Retry-After`` header from the server takes the place
    of that wait, and is capped at ``max_backoff`` too.

    ``extra_body`` adds fields to the request body (``temperature``,
    ``max_tokens``, ...); the fields the adapter sets itself (``model``,
    ``messages``, ``tools``, ``stream``) win. The adapter asks for token counts
    with ``stream_options: {"include_usage": true}`` unless ``extra_body`` has
    ``stream_options`` of its own (give ``{"include_usage": False}`` to a server
    that refuses to count, ``None`` to leave the field out for a server that does
    not know it). ``headers`` adds HTTP headers.

    ``client`` is an ``httpx.AsyncClient`` to share (its connection pool and
    timeouts are used, and it is never closed here); give it a read timeout of
    ``None`` (``httpx.Timeout(60.0, read=None)``), since httpx's default of 5
    seconds is shorter than many models take to start answering. Without one,
    each call of :meth:`stream` opens its own client and closes it at the end.

    Constructing the model does no I/O. There is no timeout parameter: wrap
    the turn in ``trio.fail_after`` (or ``move_on_after``).
    """

    base_url: str = attrs.field(validator=_check_url)
    model: str = attrs.field(validator=_check_model_name)
    api_key: str | None = attrs.field(default=None, repr=False, validator=_check_api_key)
    max_retries: int = attrs.field(default=3, kw_only=True, validator=_check_retries)
    backoff: float = attrs.field(default=0.5, kw_only=True, validator=_check_finite)
    max_backoff: float = attrs.field(default=8.0, kw_only=True, validator=_check_finite)
    extra_body: Mapping[str, Any] | None = attrs.field(
        default=None,
        kw_only=True,
        repr=False,
        validator=_check_optional(Mapping, "a mapping of request fields"),
    )
    headers: Mapping[str, str] | None = attrs.field(
        default=None, kw_only=True, repr=False, validator=_check_headers
    )
    client: httpx.AsyncClient | None = attrs.field(
        default=None,
        kw_only=True,
        repr=False,
        validator=_check_optional(httpx.AsyncClient, "an httpx.AsyncClient"),
    )
    # Loading the CA bundle takes tens of milliseconds of blocking work: it is
    # done once, in a worker thread, and shared by the clients this model owns.
    _ssl_context: ssl.SSLContext | None = attrs.field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        """The endpoint the model posts to: ``base_url``'s path and ``/chat/completions``
        (a query in ``base_url``, such as Azure's ``?api-version=...``, is kept)."""
        base = httpx.URL(self.base_url)
        return str(base.copy_with(path=base.path.rstrip("/") + "/chat/completions"))

    @property
    def _where(self) -> str:
        """:attr:`url` as messages show it: a password in it is hidden (they are stored)."""
        url = httpx.URL(self.url)
        if url.password:
            url = url.copy_with(username=url.username, password="***")
        return str(url)

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelChunk, None]:
        """Stream the answer to ``request``: text and tool-call fragments as they arrive.

        Raises :class:`~sessionactors.ModelError` when the server refuses the
        request, keeps failing, or sends something that is not a chat
        completion stream. Cancelling the task reading the stream, or
        closing the generator early (read it inside
        ``contextlib.aclosing(model.stream(request))``), closes the HTTP
        response.
        """
        session_id = request.session_id
        url = self.url
        payload = self._encode(request)
        headers = self._request_headers()
        yielded = False
        async with contextlib.AsyncExitStack() as stack:
            client = self.client
            if client is None:
                if self._ssl_context is None:
                    self._ssl_context = await anyio.to_thread.run_sync(httpx.create_ssl_context)
                client = await stack.enter_async_context(
                    httpx.AsyncClient(timeout=_TIMEOUT, verify=self._ssl_context)
                )
            attempt = 0
            while True:
                delay: float
                try:
                    async with client.stream(
                        "POST", url, content=payload, headers=headers
                    ) as response:
                        status = response.status_code
                        if not 200 <= status < 300:
                            detail = await self._error_detail(response)
                            if status not in _RETRYABLE_STATUS or attempt >= self.max_retries:
                                location = response.headers.get("location")
                                self._raise_status(session_id, status, detail, attempt, location)
                            delay = self._delay(attempt, response.headers)
                        else:
                            await self._check_content_type(session_id, response)
                            parser = _StreamParser(self, session_id)
                            text = _BoundedText(response, self, session_id)
                            events = EventSource(cast(httpx.Response, text)).aiter_sse()
                            async with contextlib.aclosing(events):
                                async for event in events:
                                    text.pending = 0
                                    chunks = parser.feed(event.event, event.data)
                                    for chunk in chunks:
                                        yielded = True
                                        yield chunk
                                    if parser.done:
                                        if self.client is not None:  # (a pool to go back to)
                                            await _drain(events)
                                        break
                            parser.finish()
                            if parser.usage is not None:  # the answer's last totals, once
                                yielded = True
                                yield parser.usage
                            return
                except _RETRYABLE_ERRORS as exc:
                    if yielded:
                        raise ModelError(
                            f"session {session_id!r}: the stream from {self._where} broke after "
                            f"part of the answer had arrived ({_describe(exc)}); "
                            "the partial answer cannot be resumed, run the turn again",
                            session_id=session_id,
                        ) from exc
                    tls = _tls_error(exc)
                    if tls is not None and (_lasting(tls) or attempt >= self.max_retries):
                        raise ModelError(
                            f"session {session_id!r}: TLS with {self._where} failed ({tls}); "
                            "check base_url's scheme (https:// only for a server that speaks "
                            "TLS) and that the server's certificate is trusted (for a private "
                            "CA, give client=httpx.AsyncClient(verify=...))",
                            session_id=session_id,
                        ) from exc
                    if attempt >= self.max_retries:
                        if isinstance(exc, httpx.PoolTimeout):  # the client's, not the server's
                            advice = (
                                "every connection of the client's pool stayed busy: give it "
                                "more (httpx.Limits(max_connections=...)) or a longer pool "
                                "timeout"
                            )
                        else:
                            advice = "check that the server is running and that base_url is right"
                        raise ModelError(
                            f"session {session_id!r}: could not get an answer from {self._where} "
                            f"after {attempt + 1} attempt(s) ({_describe(exc)}); {advice}",
                            session_id=session_id,
                        ) from exc
                    delay = self._delay(attempt, None)
                except httpx.HTTPError as exc:
                    raise ModelError(
                        f"session {session_id!r}: the request to {self._where} failed "
                        f"({_describe(exc)}); check base_url and the client's settings",
                        session_id=session_id,
                    ) from exc
                attempt += 1
                await anyio.sleep(delay)

    # -- the request ---------------------------------------------------------

    def _encode(self, request: ModelRequest) -> bytes:
        body: dict[str, Any] = dict(self.extra_body or {})
        body["model"] = self.model
        body["messages"] = [_message_to_openai(m, request.session_id) for m in request.messages]
        if request.tools:
            body["tools"] = [_tool_to_openai(t) for t in request.tools]
        else:
            body.pop("tools", None)
        body["stream"] = True
        body.setdefault("stream_options", {"include_usage": True})
        if body["stream_options"] is None:  # for a server that does not know the field
            del body["stream_options"]
        try:
            return json.dumps(body, ensure_ascii=False, default=_json_default).encode()
        except (TypeError, ValueError) as exc:
            raise ModelError(
                f"session {request.session_id!r}: the request body cannot be written as JSON "
                f"({exc}); tool parameters and extra_body must hold only JSON values",
                session_id=request.session_id,
            ) from exc

    def _request_headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
        headers.update(self.headers or {})
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    # -- the response --------------------------------------------------------

    async def _check_content_type(self, session_id: str, response: httpx.Response) -> None:
        content_type = response.headers.get("content-type", "")
        if "text/event-stream" not in content_type.partition(";")[0]:
            # (a proxy may answer 200 with its error as JSON: quote what it said)
            detail = await self._error_detail(response)
            raise ModelError(
                f"session {session_id!r}: {self._where} answered with content-type "
                f"{content_type!r} instead of an event stream: {detail}; check that base_url "
                "points to an OpenAI-compatible API (it usually ends in /v1)",
                session_id=session_id,
            )

    async def _error_detail(self, response: httpx.Response) -> str:
        """The server's own words about an error response, from its (bounded) body."""
        body = bytearray()
        # httpx types it as an iterator, but it is an async generator: close it.
        chunks = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                body += chunk
                if len(body) >= _MAX_ERROR_BODY:
                    break
        text = bytes(body[:_MAX_ERROR_BODY]).decode("utf-8", errors="replace")
        with contextlib.suppress(ValueError, RecursionError):
            message = _error_message(json.loads(text))
            if message:
                return _quote(message)
        title = _HTML_TITLE.search(text)
        if title is not None and " ".join(title[1].split()):  # a proxy's error page
            return _quote(f"{html.unescape(' '.join(title[1].split()))} (an HTML page)")
        return _quote(text) if text.strip() else (response.reason_phrase or "no details")

    def _raise_status(
        self, session_id: str, status: int, detail: str, attempt: int, location: str | None
    ) -> NoReturn:
        if 300 <= status < 400:
            # not followed: a redirect could take the api_key to another host
            where = f"to {_quote(location)}" if location else "elsewhere"
            advice = f"it redirects {where}: set base_url to the API root there"
        elif status in (401, 403):
            advice = "check the api_key"
        elif status == 404:
            advice = "check base_url (it usually ends in /v1) and the model name"
        elif status in _RETRYABLE_STATUS:
            advice = (
                f"gave up after {attempt + 1} attempt(s); try again later "
                "or raise max_retries and max_backoff"
            )
        elif 400 <= status < 500:
            advice = "check the messages, the tools' schemas and extra_body"
            if "stream_options" in detail:
                advice = (
                    "a server that does not know stream_options (the adapter asks for token "
                    "counts with it) takes extra_body={'stream_options': None}, which leaves "
                    "it out"
                )
        else:
            advice = "check base_url"
        raise ModelError(
            f"session {session_id!r}: {self._where} answered HTTP {status}: {detail}; {advice}",
            session_id=session_id,
            status_code=status,
        )

    def _delay(self, attempt: int, headers: httpx.Headers | None) -> float:
        """How long to wait before attempt number ``attempt + 1``."""
        if headers is not None:
            retry_after = _retry_after(headers)
            if retry_after is not None:
                return min(retry_after, self.max_backoff)
        delay = self.backoff * 2.0**attempt
        return min(delay * (1.0 + 0.25 * random.random()), self.max_backoff)


@attrs.define(eq=False)
class _BoundedText:
    """A response as httpx-sse reads it (its headers and text), which fails with a
    ModelError once the event being read is over :data:`_MAX_EVENT_CHARS`.

    ``pending`` counts the characters read since the last event came out (its
    reader sets it back to 0), give or take one read of the network.
    """

    response: httpx.Response
    model: OpenAIChatModel
    session_id: str
    pending: int = 0
    _texts: AsyncIterator[str] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._texts = self.response.aiter_text()

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    def aiter_text(self) -> AsyncIterator[str]:
        # (an iterator, not an async generator: httpx-sse does not close what it reads)
        return self

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        text = await self._texts.__anext__()
        self.pending += len(text)
        if self.pending > _MAX_EVENT_CHARS:
            raise ModelError(
                f"session {self.session_id!r}: {self.model._where} sent more than "
                f"{_MAX_EVENT_CHARS:,} characters without ending an event (no line "
                "end), more than any answer needs, so it was stopped; check that "
                "base_url points to an OpenAI-compatible API (and any proxy between)",
                session_id=self.session_id,
            )
        return text


@attrs.define(eq=False)
class _StreamParser:
    """Turns the events of one chat completion stream into chunks."""

    model: OpenAIChatModel
    session_id: str
    done: bool = False
    finished: bool = False
    #: the last usage the stream reported: a running total (some servers send it with
    #: every chunk), given once at the end
    usage: UsageChunk | None = None

    def feed(self, event: str, data: str) -> list[ModelChunk]:
        if not data or event not in ("message", "error"):
            # A ``retry:``-only block, a keep-alive, an event without data, or one of a
            # type of its own (a proxy's ``event: ping``), which an EventSource passes over.
            return []
        if data.strip() == "[DONE]":
            self.done = True
            return []
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):  # (nested too deep for the parser)
            if event == "error":  # the server's error, in plain words
                self._reported(data)
            self._malformed(f"an event's data is not JSON: {_quote(data)}")
        if not isinstance(payload, dict):
            if event == "error":
                self._reported(data)
            self._malformed(f"an event's data is not a JSON object: {_quote(data)}")
        if payload.get("error") is not None or event == "error":
            self._reported(_error_message(payload) or data)
        choices = payload.get("choices")
        if not isinstance(choices, list):
            self._malformed(f"a chunk has no 'choices' list: {_quote(data)}")
        chunks: list[ModelChunk] = []
        usage = payload.get("usage")
        if usage is not None:  # (null in every chunk but the last, with include_usage)
            self.usage = self._usage_chunk(usage, data)
        for choice in choices:
            if not isinstance(choice, dict):
                self._malformed(f"a choice is not a JSON object: {_quote(data)}")
            if choice.get("index") not in (0, None):
                continue  # only the first choice is the answer
            reason = choice.get("finish_reason")
            if reason:
                self.finished = True
            delta = choice.get("delta")
            if delta is not None:
                self._take_delta(delta, data, chunks)
            if reason:  # (after the text it ends)
                if not isinstance(reason, str):
                    self._malformed(f"a choice's 'finish_reason' is not a string: {_quote(data)}")
                if reason not in _NATURAL_ENDS:
                    chunks.append(FinishChunk(reason))
        return chunks

    def _take_delta(self, delta: object, data: str, chunks: list[ModelChunk]) -> None:
        """Append the chunks of one choice's ``delta`` to ``chunks``."""
        if not isinstance(delta, dict):
            self._malformed(f"a choice's 'delta' is not a JSON object: {_quote(data)}")
        for field in ("content", "refusal"):  # (a refusal is the answer's text too)
            content = delta.get(field)
            if content is not None:
                if not isinstance(content, str):
                    self._malformed(f"'delta.{field}' is not a string: {_quote(data)}")
                if content:
                    chunks.append(TextChunk(content))
        tool_calls = delta.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                self._malformed(f"'delta.tool_calls' is not a list: {_quote(data)}")
            for position, fragment in enumerate(tool_calls):
                chunks.append(self._tool_call_chunk(fragment, position, data))

    def finish(self) -> None:
        """Check, once the stream has ended, that it ended properly."""
        if not (self.done or self.finished):
            raise ModelError(
                f"session {self.session_id!r}: the stream from {self.model._where} ended before "
                "'data: [DONE]' and without a finish_reason, so the answer may be cut short; "
                "run the turn again",
                session_id=self.session_id,
            )

    def _tool_call_chunk(self, fragment: object, position: int, data: str) -> ToolCallChunk:
        if not isinstance(fragment, dict):
            self._malformed(f"a tool call fragment is not a JSON object: {_quote(data)}")
        index = fragment.get("index", position)
        call_id = fragment.get("id")
        function = fragment.get("function") or {}
        if not isinstance(function, dict):
            self._malformed(f"a tool call's 'function' is not a JSON object: {_quote(data)}")
        name = function.get("name")
        arguments = function.get("arguments")
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or not isinstance(call_id, str | None)
            or not isinstance(name, str | None)
            or not isinstance(arguments, str | None)
        ):
            self._malformed(f"a tool call fragment has fields of the wrong type: {_quote(data)}")
        return ToolCallChunk(
            index, id=call_id or None, name=name or None, arguments=arguments or ""
        )

    def _usage_chunk(self, usage: object, data: str) -> UsageChunk:
        if not isinstance(usage, dict):
            self._malformed(f"'usage' is not a JSON object: {_quote(data)}")
        counts = [usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0]
        for count in counts:
            if count.__class__ is not int or count < 0:
                self._malformed(f"'usage' holds a count that is not an integer: {_quote(data)}")
        return UsageChunk(*counts)

    def _reported(self, message: str) -> NoReturn:
        raise ModelError(
            f"session {self.session_id!r}: {self.model._where} reported an error in the "
            f"stream: {_quote(message)}; check the request, or run the turn again",
            session_id=self.session_id,
        )

    def _malformed(self, what: str) -> NoReturn:
        raise ModelError(
            f"session {self.session_id!r}: {self.model._where} sent a malformed stream: {what}; "
            "check that base_url points to an OpenAI-compatible API",
            session_id=self.session_id,
        )


def _message_to_openai(message: Message, session_id: str) -> dict[str, Any]:
    if message.role is Role.TOOL:
        if message.tool_call_id is None:
            raise ModelError(
                f"session {session_id!r}: tool message {message.id!r} has no tool_call_id, "
                "so the model cannot tell which call it answers",
                session_id=session_id,
            )
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    converted: dict[str, Any] = {"role": message.role.value, "content": message.content}
    if message.role is Role.ASSISTANT and message.tool_calls:
        converted["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
        if not message.content:
            converted["content"] = None
    return converted


def _tool_to_openai(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


def _error_message(payload: object) -> str | None:
    """The message in an error body: OpenAI's ``{"error": {"message"}}`` and its cousins."""
    if not isinstance(payload, dict):
        return None
    error = payload.get("error", payload)
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        for key in ("message", "detail", "error"):
            value = error.get(key)
            if isinstance(value, str):
                return value
    return None


async def _drain(events: AsyncGenerator[Any, None]) -> None:
    """Read a stream on after its ``data: [DONE]`` to the end of its body, for a while.

    A response closed before its end takes its connection with it; read to its end
    (which a server sends with ``[DONE]``), it gives the connection back to the
    client's pool for the next call. A server that keeps the response open is left
    after :data:`_DRAIN_SECONDS`; what comes after ``[DONE]`` is not the answer.
    """
    with anyio.move_on_after(_DRAIN_SECONDS), contextlib.suppress(httpx.HTTPError, ModelError):
        async for _ in events:
            pass


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from, nearest first (a few at most)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 8 and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _describe(exc: BaseException) -> str:
    """The error's type and its first words along its causes: under trio, httpx raises
    ``ConnectError('')`` from the error that says what happened."""
    for cause in _causes(exc):
        if str(cause):
            return f"{type(exc).__name__}: {cause}"
    return type(exc).__name__


def _tls_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a transport error, if there is one."""
    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLError):
            return cause
    return None


def _lasting(error: ssl.SSLError) -> bool:
    """Whether a TLS error will be there on the next attempt too: an untrusted
    certificate, or a server that does not speak TLS."""
    return isinstance(error, ssl.SSLCertVerificationError) or error.reason in (
        "WRONG_VERSION_NUMBER",
        "HTTP_REQUEST",
        "RECORD_LAYER_FAILURE",
    )


def _retry_after(headers: httpx.Headers) -> float | None:
    """The wait a server asked for, in seconds, or ``None`` when it asked for none."""
    value = headers.get("retry-after-ms")
    if value is not None:
        with contextlib.suppress(ValueError):
            return max(0.0, float(value) / 1000.0)
    value = headers.get("retry-after")
    if value is None:
        return None
    with contextlib.suppress(ValueError):
        return max(0.0, float(value))
    with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())
    return None
