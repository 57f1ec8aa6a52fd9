"""Request bodies as an attacker sends them: too slowly, built to swell as they are
parsed, cut off half-way, or at a path a redirect would answer. Each is answered (or
dropped) at once and bounded, on hypercorn's trio worker and on uvicorn alike."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from .servers import Serve

HEADERS = (
    "POST /sessions/slow/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    "Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
)


async def _connect(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").split(":")
    return await trio.open_tcp_stream(host, int(port))


async def _post_bytes(client: httpx.AsyncClient, name: str, body: bytes) -> httpx.Response:
    """POST ``body``, as JSON, as a message to session ``name``."""
    return await client.post(
        f"/sessions/{name}/messages", content=body, headers={"content-type": "application/json"}
    )


async def _response(stream: trio.SocketStream, begun: trio.Event | None = None) -> bytes:
    """What the server sends until it closes the connection (``begun`` is set once its
    first bytes came). A reset after them ends it too: a client that was still sending
    when the server closed gets one, once the server's kernel sees its bytes."""
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
            if begun is not None:
                begun.set()
    except trio.BrokenResourceError:
        if not data:
            raise
    return data


async def test_a_body_that_never_ends_is_answered_408_within_its_bound(serve: Serve) -> None:
    """A client that sends a body's first bytes and then one byte a while holds the
    server's memory for the body for no longer than ``body_timeout``: it gets 408
    ``RequestTimeout``, which says what to do, and its connection is closed."""
    async with serve(body_timeout=1.0) as served, await _connect(served.url) as stream:
        with trio.fail_after(10):
            await stream.send_all(HEADERS.format(length=100_000).encode() + b'{"text": "')
            answered = trio.Event()
            async with trio.open_nursery() as nursery:

                async def trickle() -> None:
                    for _ in range(40):
                        await trio.sleep(0.25)
                        if answered.is_set():  # (bytes sent after the close reset it)
                            return
                        try:
                            await stream.send_all(b"a")
                        except trio.BrokenResourceError:
                            return

                nursery.start_soon(trickle)
                answer = await _response(stream, answered)
                nursery.cancel_scope.cancel()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"RequestTimeout" in body
        assert b"1 s" in body


async def test_a_body_of_a_million_empty_objects_is_refused_before_it_is_parsed(
    serve: Serve,
) -> None:
    """A body of small JSON containers (``[{}, {}, ...]``: millions of dicts from a
    few MiB, seconds of the event loop) is refused with 422 before it is parsed; as many
    braces inside a string (a message of code) are text, and the message is answered."""
    many = b'{"text": [' + b"{}," * 1_000_000 + b"{}]}"
    braces = b'{"text": "' + b"{}[]" * 200_000 + b'"}'
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(30):
            r = await _post_bytes(client, "swell", many)
            assert r.status_code == 422, r.text
            assert r.json()["error"] == "InvalidJSON"
            assert "JSON values" in r.json()["message"]
            r = await _post_bytes(client, "swell", braces)
            assert r.status_code == 200, r.text[:300]


async def test_a_client_that_hangs_up_mid_body_is_no_server_error(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that closes its connection half-way through a body is gone, not a
    failure of the server: nothing is logged at ERROR (an operator's alert), and the
    server goes on."""
    caplog.set_level(logging.INFO)
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            for _ in range(3):
                stream = await _connect(served.url)
                await stream.send_all(HEADERS.format(length=1000).encode() + b'{"text": "half')
                await trio.sleep(0.1)
                await stream.aclose()
            await trio.sleep(0.5)
            r = await client.post("/sessions/after/messages", json={"text": "still here"})
            assert r.status_code == 200, r.text
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert failed == [], [r.getMessage() for r in failed]


async def test_a_path_with_a_trailing_slash_is_not_redirected_to_the_callers_host(
    serve: Serve,
) -> None:
    """``/sessions/`` (a slash too many) is not redirected (a redirect would name the
    caller's ``Host`` before the gateway's own check of it, and a 307 posts the body
    again there): it is 404, no route, under any ``Host``."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        port = served.url.rsplit(":", 1)[1]
        with trio.fail_after(20):
            for method, path in [
                ("GET", "/sessions/"),
                ("GET", "/sessions/a/"),
                ("POST", "/sessions/a/messages/"),
            ]:
                body = b'{"text": "x"}' if method == "POST" else None
                r = await client.request(method, path, content=body)
                assert r.status_code == 404, (path, r.status_code, r.headers)
                assert "location" not in r.headers
                r = await client.request(
                    method, path, content=body, headers={"host": f"evil.example:{port}"}
                )
                assert r.status_code == 404, (path, r.status_code)
                assert "location" not in r.headers


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), True, "30"])
def test_a_body_timeout_that_is_no_time_is_refused(seconds: object) -> None:
    """``create_app(body_timeout=...)`` takes seconds > 0; anything else is refused when
    the app is made, naming the option."""
    from sessionactors.http import create_app

    from .chat_agents import echo

    with pytest.raises(ValueError, match="body_timeout must be a number of seconds > 0"):
        create_app(agents=echo, body_timeout=seconds)  # type: ignore[arg-type]


async def test_a_review_note_over_the_limit_is_invalid_request_as_a_long_message_is(
    serve: Serve,
) -> None:
    """A review's note that ``ref.review`` would refuse (over 1 MiB) is answered as a
    message's text is: 422 ``InvalidRequest`` naming the session, before the review is
    looked up."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            r = await client.post("/sessions/rev/messages", json={"text": "hi"})
            assert r.status_code == 200, r.text
            r = await client.post(
                "/sessions/rev/reviews/r1", json={"approve": True, "note": "n" * 1_100_000}
            )
            assert r.status_code == 422, r.text
            assert r.json()["error"] == "InvalidRequest"
            assert "'rev'" in r.json()["message"]
            assert "over the limit" in r.json()["message"]


@pytest.mark.parametrize(
    "body",
    [
        # an unterminated string of escaped quotes behind many brackets: a string
        # pattern that must end in a quote tries again from every escape
        b"[" * 100_001 + b'"' + b'\\"' * 200_000,
        # small values, no containers: a parse of millions of floats
        b'{"text": [' + b"1.5," * 3_000_000 + b"1.5]}",
    ],
    ids=["unterminated-escapes", "many-floats"],
)
async def test_bodies_built_to_be_slow_to_check_or_parse_are_refused_at_once(
    serve: Serve, body: bytes
) -> None:
    """A body whose check or parse would take the event loop for seconds (a string of
    escapes that never ends, millions of small values) is refused with 422 at once, and
    the server answers its health check meanwhile."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(30):
            r = await _post_bytes(client, "slow", body)
            assert r.status_code == 422, r.text[:300]
            assert r.json()["error"] == "InvalidJSON"
            assert (await client.get("/healthz")).status_code == 200
