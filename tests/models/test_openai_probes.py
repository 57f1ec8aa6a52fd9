"""OpenAIChatModel probed as providers and proxies behave, against real servers on loopback."""

import asyncio
import contextlib
import json
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

import sessionactors as sa
import sessionactors.aio as aio
from sessionactors.models import OpenAIChatModel

from .fake_openai_server import FakeOpenAI, Reply, error_reply, open_fake_openai, text_reply

# Real sockets: never the autojump clock here; every wait is bounded by real time.
WAIT = 10


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with open_fake_openai() as app:
        yield app


async def send_one(model: OpenAIChatModel, text: str = "hello") -> sa.Reply:
    """One turn of a fresh session on ``model``, bounded in time."""
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
            ref = await registry.spawn("probe-1")
            return await ref.send(text)


async def failed_turn(model: OpenAIChatModel) -> sa.ModelError:
    """The ModelError that fails one turn on ``model``."""
    with pytest.raises(sa.TurnFailedError) as info:
        await send_one(model)
    cause = info.value.__cause__
    assert isinstance(cause, sa.ModelError)
    assert cause.session_id == "probe-1"
    return cause


# -- the URL and the credentials -------------------------------------------------


async def test_a_base_url_with_a_query_keeps_it_after_the_path(fake: FakeOpenAI) -> None:
    """A base_url with a query (Azure's ?api-version=...) posts to {path}/chat/completions
    with the query kept, not to a path hidden inside the query."""
    fake.push(text_reply("ok"))
    model = OpenAIChatModel(fake.base_url + "/?api-version=2024-02-01", "m")
    assert model.url == fake.base_url + "/chat/completions?api-version=2024-02-01"
    assert (await send_one(model)).text == "ok"
    assert [r.path for r in fake.requests] == ["/v1/chat/completions"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"base_url": "http://127.0.0.1:8000/v1\n"}, "base_url"),
        ({"base_url": "http://"}, "base_url"),
        ({"base_url": "http://:8000/v1"}, "base_url"),
        ({"base_url": "http://127.0.0.1:99999/v1"}, "base_url"),
        ({"api_key": "sk-abc\n"}, "api_key"),
        ({"api_key": "sk-\u00e9t\u00e9"}, "api_key"),
        ({"api_key": ""}, "api_key"),
        ({"headers": {"X-Team": "a\r\nX-Evil: 1"}}, "headers"),
        ({"headers": {"X-T\u00e9am": "a"}}, "headers"),
        ({"headers": {"X Team": "a"}}, "headers"),
    ],
)
def test_settings_that_cannot_be_sent_are_refused_when_made(
    kwargs: dict[str, Any], field: str
) -> None:
    """A base_url httpx cannot parse, or an api_key or header an HTTP request cannot carry
    (a newline read from a file, a non-ASCII character), is refused with a ValueError naming
    the setting when the model is made, not as an obscure failure of every turn."""
    settings: dict[str, Any] = {"base_url": "http://127.0.0.1:8000/v1", "model": "m", **kwargs}
    with pytest.raises(ValueError, match=field):
        OpenAIChatModel(**settings)


# -- what the server said --------------------------------------------------------


async def test_a_json_error_answered_with_200_is_quoted(fake: FakeOpenAI) -> None:
    """A proxy that answers 200 with a JSON error body (not an event stream) fails the
    turn with a ModelError that quotes the provider's message."""
    body = {"error": {"message": "Rate limit reached for gpt-4o-mini", "code": 429}}
    fake.push(
        Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(body).encode(),))
    )
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert "Rate limit reached for gpt-4o-mini" in str(error)
    assert "application/json" in str(error)


async def test_a_redirect_names_where_it_points(fake: FakeOpenAI) -> None:
    """A redirect (http to https, a moved API) is not followed with the key in it: the
    ModelError names the status and the Location, and says to fix base_url."""
    target = "https://api.example.com/v1/chat/completions"
    fake.push(Reply(status=308, headers=(("location", target),)))
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert error.status_code == 308
    assert target in str(error)
    assert "base_url" in str(error)
    assert len(fake.requests) == 1


# -- asyncio ---------------------------------------------------------------------


@attrs.define(eq=False)
class AsyncioServer:
    """A minimal chat completions server on asyncio: answers "hi", or (``stall``) sends
    "part" and waits for the client to hang up. Counts the connections open."""

    base_url: str = ""
    stall: bool = False
    open_connections: int = 0
    hung_up: asyncio.Event = attrs.Factory(asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if self.stall:
                    part = b"data: " + json.dumps(chunk({"content": "part"})).encode() + b"\n\n"
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(part), part)
                    )
                    await writer.drain()
                    while await reader.read(65536):
                        pass
                    self.hung_up.set()
                    return
                events = [chunk({"content": "hi"}), chunk({}, "stop")]
                body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                body += b"data: [DONE]\n\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"content-length: %d\r\n\r\n" % len(body) + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_connections -= 1
            writer.close()


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


@contextlib.asynccontextmanager
async def serve_asyncio_openai() -> AsyncIterator[AsyncioServer]:
    """Serve a fresh :class:`AsyncioServer` on loopback (asyncio)."""
    app = AsyncioServer()
    handlers: set[asyncio.Task[None]] = set()

    def start(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.add(asyncio.ensure_future(app.handle(reader, writer)))

    server = await asyncio.start_server(start, "127.0.0.1", 0)
    app.base_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        yield app
    finally:
        server.close()
        await server.wait_closed()
        if handlers:  # each ends when its client hangs up
            await asyncio.wait(handlers, timeout=WAIT)


def run_asyncio(main: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(WAIT * 2):
            await main

    asyncio.run(bounded())


def test_under_aio_a_client_shared_with_asyncio_code_works_on_both_sides() -> None:
    """Under sessionactors.aio, an httpx.AsyncClient that the asyncio app uses too (one
    client for the whole app) carries the model's turns, and the app's own requests
    still work after them."""

    async def main() -> None:
        async with (
            serve_asyncio_openai() as server,
            httpx.AsyncClient(timeout=httpx.Timeout(WAIT, read=None)) as client,
        ):
            base_url = server.base_url
            url = base_url + "/chat/completions"
            assert (await client.post(url, json={})).status_code == 200  # the app's own use
            model = OpenAIChatModel(base_url, "m", max_retries=0, client=client)
            async with aio.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
                ref = await registry.spawn("aio-1")
                assert (await ref.send("one")).text == "hi"
                assert (await client.post(url, json={})).status_code == 200
                assert (await ref.send("two")).text == "hi"

    run_asyncio(main())


def test_under_aio_cancel_closes_the_connection_and_many_turns_leak_none() -> None:
    """Under sessionactors.aio, many turns leave no connection open at the server, and
    ref.cancel() of a turn whose stream stalls makes the server see the hang-up at once;
    what was streamed is kept, marked interrupted."""

    async def main() -> None:
        async with serve_asyncio_openai() as server:
            model = OpenAIChatModel(server.base_url, "m", max_retries=0)
            async with aio.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
                ref = await registry.spawn("aio-2")
                for _ in range(20):
                    assert (await ref.send("again")).text == "hi"
                async with asyncio.timeout(2):  # each turn's connection closes with it
                    while server.open_connections:
                        await asyncio.sleep(0.01)
                server.stall = True
                async with ref.stream("stall") as events:
                    async for event in events:
                        if isinstance(event, sa.Delta):  # "part" arrived: the stream stalls
                            assert await ref.cancel()
                        elif isinstance(event, sa.TurnCancelled):
                            break
                async with asyncio.timeout(2):
                    await server.hung_up.wait()
                last = (await ref.history())[-1]
                assert (last.content, last.interrupted) == ("part", True)

    run_asyncio(main())


# -- the stream ------------------------------------------------------------------


async def test_an_endless_line_fails_the_turn_instead_of_filling_memory(
    fake: FakeOpenAI,
) -> None:
    """A stream that sends megabytes with no line end (a broken proxy) fails the turn
    with a ModelError once one event is over 16 MiB characters, instead of buffering
    it all while the server keeps sending; the connection is closed."""
    line = b"data: " + b"a" * (17 * 1024 * 1024)
    fake.push(Reply(pieces=(line,), stall=True))
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert "line end" in str(error)
    with trio.fail_after(WAIT):
        await fake.disconnected.wait()


# -- TLS -------------------------------------------------------------------------


async def test_an_untrusted_certificate_is_named_and_not_retried(
    tls_certificate: tuple[Path, Path],
) -> None:
    """A server whose certificate is not trusted (self-signed) fails the turn at the
    first attempt with a ModelError that says TLS failed and why (under trio httpx's
    own message is empty), and says how to trust it."""
    cert, key = tls_certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    handshakes = 0

    async def serve(stream: trio.SocketStream) -> None:
        nonlocal handshakes
        handshakes += 1
        with contextlib.suppress(trio.BrokenResourceError):
            await trio.SSLStream(stream, context, server_side=True).do_handshake()

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        model = OpenAIChatModel(f"https://127.0.0.1:{port}/v1", "m", backoff=0.001)
        error = await failed_turn(model)
        nursery.cancel_scope.cancel()
    assert "TLS" in str(error)
    assert "CERTIFICATE_VERIFY_FAILED" in str(error)
    assert "verify=" in str(error)
    assert handshakes == 1


async def test_https_to_a_plain_http_server_says_tls_failed(fake: FakeOpenAI) -> None:
    """base_url with https:// for a server that speaks plain HTTP fails the turn with a
    ModelError that names TLS and the scheme to check, not an empty ConnectError."""
    model = OpenAIChatModel(fake.base_url.replace("http://", "https://"), "m", max_retries=0)
    error = await failed_turn(model)
    assert "TLS" in str(error)
    assert "https://" in str(error)
    assert fake.requests == []


# -- tool calls ------------------------------------------------------------------


def call_chunk(function: dict[str, str], **fields: Any) -> dict[str, Any]:
    """A chunk whose first choice carries one tool call fragment (no index unless given)."""
    fragment = {"type": "function", "function": function, **fields}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}, "finish_reason": None}]}


def sse_reply(*payloads: dict[str, Any]) -> Reply:
    finished = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    events = [*payloads, finished]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return Reply(pieces=(body + b"data: [DONE]\n\n",))


async def run_tool_turn(fake: FakeOpenAI, *calls: dict[str, Any]) -> list[str]:
    """One turn whose first answer streams ``calls``; the order ids the tool was called
    with (each call's arguments must be whole JSON, or the tool is not called)."""
    looked_up: list[str] = []

    @sa.tool
    async def lookup(order_id: str) -> str:
        """Look an order up."""
        looked_up.append(order_id)
        return f"paid {order_id}"

    fake.push(sse_reply(*calls), text_reply("done"))
    model = OpenAIChatModel(fake.base_url, "m", max_retries=0)
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[lookup])}) as reg:
            ref = await reg.spawn("tools-1")
            assert (await ref.send("check")).text == "done"
    return looked_up


async def test_whole_calls_streamed_without_index_or_id_are_separate_calls(
    fake: FakeOpenAI,
) -> None:
    """A server that streams parallel calls one whole call a chunk with no index and no
    id (Gemini's OpenAI endpoint, some proxies) gets one call each, not one call whose
    arguments are two JSON objects run together."""
    looked_up = await run_tool_turn(
        fake,
        call_chunk({"name": "lookup", "arguments": '{"order_id": "A1"}'}),
        call_chunk({"name": "lookup", "arguments": '{"order_id": "A2"}'}),
    )
    assert sorted(looked_up) == ["A1", "A2"]


@pytest.mark.parametrize(
    "arguments",
    [['{"order_id": ', '"A1"}'], ["", '{"order_id": "A1"}'], ['{"order_id": "A1"}', " "]],
    ids=["split", "empty first", "trailing space"],
)
async def test_a_name_repeated_in_every_fragment_is_still_one_call(
    fake: FakeOpenAI, arguments: list[str]
) -> None:
    """A server that repeats the name in every fragment of one call (no id) still gets
    one call, run once with the joined arguments."""
    chunks = [call_chunk({"name": "lookup", "arguments": a}, index=0) for a in arguments]
    assert await run_tool_turn(fake, *chunks) == ["A1"]


async def test_a_name_split_across_fragments_is_joined(fake: FakeOpenAI) -> None:
    """A server that splits a call's name across its first fragments, as it splits the
    arguments, gets the call of the joined name (the last piece named an unknown tool)."""
    chunks = [
        call_chunk({"name": "loo"}, index=0, id="call_1"),
        call_chunk({"name": "kup"}, index=0),
        call_chunk({"arguments": '{"order_id": '}, index=0),
        call_chunk({"arguments": '"A1"}'}, index=0),
    ]
    assert await run_tool_turn(fake, *chunks) == ["A1"]


async def test_an_event_of_another_type_is_passed_over(fake: FakeOpenAI) -> None:
    """An SSE event of a type of its own (a proxy's ``event: ping``) is passed over, as
    a browser's EventSource passes it over; it failed the turn as a malformed chunk."""
    pieces = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "one "}}]}\n\n',
        b"event: ping\ndata: {}\n\n",
        b'data: {"choices": [{"index": 0, "delta": {"content": "two"}}]}\n\n',
        b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n',
        b"data: [DONE]\n\n",
    )
    fake.push(Reply(pieces=pieces))
    reply = await send_one(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert reply.text == "one two"


# -- cancel ----------------------------------------------------------------------


async def test_ref_cancel_of_a_stalled_stream_closes_the_connection(fake: FakeOpenAI) -> None:
    """ref.cancel() of a turn whose stream stalled (the server sends nothing more, and
    there is no read timeout) ends the turn at once: the server sees the client hang
    up, and what was streamed is kept, marked interrupted."""
    fake.push(
        Reply(
            pieces=(b'data: {"choices": [{"index": 0, "delta": {"content": "so far"}}]}\n\n',),
            stall=True,
        )
    )
    model = OpenAIChatModel(fake.base_url, "m", max_retries=0)
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
            ref = await registry.spawn("cancel-1")
            async with ref.stream("hello") as events:
                async for event in events:
                    if isinstance(event, sa.Delta):
                        assert await ref.cancel()
                    elif isinstance(event, sa.TurnCancelled):
                        break
            await fake.disconnected.wait()
            last = (await ref.history())[-1]
    assert (last.content, last.interrupted) == ("so far", True)


async def test_an_error_event_with_plain_text_data_quotes_it_as_the_servers_error(
    fake: FakeOpenAI,
) -> None:
    """An ``event: error`` whose data is plain text (not JSON) fails the turn with a
    ModelError that reports the server's error in its words, not a malformed stream."""
    fake.push(
        Reply(pieces=(b'data: {"choices": []}\n\n', b"event: error\ndata: upstream timed out\n\n"))
    )
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert "reported an error" in str(error)
    assert "upstream timed out" in str(error)
    assert "malformed" not in str(error)


async def test_an_html_error_page_is_quoted_by_its_title(fake: FakeOpenAI) -> None:
    """A proxy's HTML error page (a CDN's, whose title comes after a long head) is quoted
    by its title, so the ModelError says what the proxy said."""
    page = (
        "<!DOCTYPE html>\n"
        + '<!--[if lt IE 7]> <html class="no-js ie6 oldie" lang="en-US"> <![endif]-->\n' * 6
        + "<head>\n<title>api.example.com | 524: A timeout occurred</title>\n"
        + '<meta charset="UTF-8" />\n</head><body>...</body></html>'
    )
    fake.push(Reply(status=524, headers=(("content-type", "text/html"),), pieces=(page.encode(),)))
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert error.status_code == 524
    assert "524: A timeout occurred" in str(error)


async def test_a_full_connection_pool_is_named(fake: FakeOpenAI) -> None:
    """When a shared client's connection pool stays full (more sessions streaming at once
    than its max_connections), the turn that waited fails with a ModelError that names
    the pool and its limit, not one that says to check that the server is running."""
    fake.push(Reply(pieces=(b'data: {"choices": []}\n\n',), stall=True))
    limits = httpx.Limits(max_connections=1)
    timeout = httpx.Timeout(WAIT, read=None, pool=0.05)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = OpenAIChatModel(fake.base_url, "m", max_retries=1, backoff=0.001, client=client)
        with trio.fail_after(WAIT):
            async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
                busy = await registry.spawn("busy")
                await busy.submit("hold the only connection")
                await fake.stalled.wait()
                with pytest.raises(sa.TurnFailedError) as info:
                    await (await registry.spawn("waiting")).send("hello")
                await busy.cancel()
    assert isinstance(info.value.__cause__, sa.ModelError)
    assert "max_connections" in str(info.value.__cause__)


async def test_a_password_in_base_url_stays_out_of_errors(fake: FakeOpenAI) -> None:
    """A base_url with credentials (http://user:password@host/v1, which some proxies use)
    sends them, but no error message (nor the TurnFailed event that is stored) shows the
    password."""
    fake.push(error_reply(400, "bad request"))
    base_url = fake.base_url.replace("http://", "http://ada:s3cret-pw@")
    model = OpenAIChatModel(base_url + "?api-version=1", "m", max_retries=0)
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
            ref = await registry.spawn("creds-1")
            async with ref.stream("hello") as events:
                outcome = [e async for e in events][-1]
    assert isinstance(outcome, sa.TurnFailed)
    assert "bad request" in outcome.error
    assert "s3cret-pw" not in outcome.error
    assert "authorization" in fake.requests[0].headers


@pytest.mark.parametrize("base_url", [" http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1 "])
def test_a_base_url_with_a_space_at_either_end_is_refused(base_url: str) -> None:
    """A base_url read with a space at its start or end is refused when the model is made
    (at its end it was sent as /v1%20/chat/completions)."""
    with pytest.raises(ValueError, match="base_url"):
        OpenAIChatModel(base_url, "m")


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "reply",
    [
        Reply(pieces=(b"data: " + DEEP + b"\n\n",)),
        Reply(status=400, headers=(("content-type", "application/json"),), pieces=(DEEP,)),
    ],
    ids=["in the stream", "in an error body"],
)
async def test_json_nested_too_deep_is_a_model_error(fake: FakeOpenAI, reply: Reply) -> None:
    """JSON nested too deep for Python's parser (a RecursionError), in a chunk or an error
    body, fails the turn with a ModelError like any malformed answer."""
    fake.push(reply)
    await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))


async def test_a_shared_client_reuses_its_connection_across_turns(fake: FakeOpenAI) -> None:
    """With a shared client, turns whose streams end with [DONE] and the end of the body
    reuse one pooled connection, instead of closing it at [DONE] and opening (and, over
    https, handshaking) a new one for every model call."""
    for _ in range(5):
        fake.push(text_reply("hi"))
    async with httpx.AsyncClient(timeout=httpx.Timeout(WAIT, read=None)) as client:
        model = OpenAIChatModel(fake.base_url, "m", max_retries=0, client=client)
        with trio.fail_after(WAIT):
            async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
                ref = await registry.spawn("pool-1")
                for _ in range(5):
                    assert (await ref.send("hello")).text == "hi"
    assert len(fake.clients) == 5
    assert len(set(fake.clients)) == 1


async def test_a_shared_client_still_leaves_a_response_kept_open_after_done(
    fake: FakeOpenAI,
) -> None:
    """With a shared client, a server that keeps the response open after [DONE] does not
    hold the turn: it ends with its answer, and the connection is closed."""
    fake.push(Reply(pieces=text_reply("hi").pieces, stall=True))
    async with httpx.AsyncClient(timeout=httpx.Timeout(WAIT, read=None)) as client:
        model = OpenAIChatModel(fake.base_url, "m", max_retries=0, client=client)
        assert (await send_one(model)).text == "hi"
        with trio.fail_after(WAIT):
            await fake.disconnected.wait()


# -- the chat command ------------------------------------------------------------


async def run_chat(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(60):
        return await trio.run_process(
            [sys.executable, "-m", "sessionactors", "chat", "--model", "m",
             "--db", str(tmp_path / "chat.db"), *args],
            stdin=b"hi\n\n", capture_stdout=True, capture_stderr=True, check=False,
            env={**os.environ, **(env or {})},
        )  # fmt: skip


async def test_chat_prints_why_a_turn_failed(fake: FakeOpenAI, tmp_path: Path) -> None:
    """When a turn fails (the server refuses the key), chat prints the error in one line
    on stderr, instead of an empty reply, and carries on."""
    fake.push(error_reply(401, "Incorrect API key provided"))
    result = await run_chat(tmp_path, "--base-url", fake.base_url)
    error = result.stderr.decode()
    assert result.returncode == 0
    assert "Incorrect API key provided" in error
    assert "Traceback" not in error


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--base-url", "localhost:8000/v1"], {}, "http://"),
        (["--base-url", "http://127.0.0.1:8000/v1", "--api-key", "sk-a\u00e9"], {}, "api_key"),
    ],
    ids=["no scheme", "non-ASCII key"],
)
async def test_chat_refuses_bad_settings_in_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], words: str
) -> None:
    """A --base-url or --api-key the model refuses ends chat with one line on stderr
    (exit status 2), not a traceback."""
    result = await run_chat(tmp_path, *args, env=env)
    error = result.stderr.decode().strip()
    assert result.returncode == 2
    assert words in error
    assert "Traceback" not in error, error
    assert len(error.splitlines()) == 1, error


async def test_chat_takes_an_empty_openai_api_key_as_none(fake: FakeOpenAI, tmp_path: Path) -> None:
    """OPENAI_API_KEY set but empty (a local server needs none) sends no key."""
    fake.push(text_reply("Hello"))
    result = await run_chat(tmp_path, "--base-url", fake.base_url, env={"OPENAI_API_KEY": ""})
    assert result.returncode == 0, result.stderr.decode()
    assert "Hello" in result.stdout.decode()
    assert "authorization" not in fake.requests[0].headers


async def test_a_server_that_does_not_know_stream_options_is_told_how_to_leave_it_out(
    fake: FakeOpenAI,
) -> None:
    """A server that refuses the stream_options field (older Azure API versions) fails the
    turn with advice to pass extra_body={'stream_options': None}, which leaves the field
    out of the request."""
    message = "Unrecognized request argument supplied: stream_options"
    fake.push(error_reply(400, message), text_reply("ok"))
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert "{'stream_options': None}" in str(error)
    model = OpenAIChatModel(fake.base_url, "m", extra_body={"stream_options": None})
    assert (await send_one(model)).text == "ok"
    assert "stream_options" not in fake.requests[-1].body
