"""A page of another origin (an app's own front end, a dev server on another port) that
uses the gateway from the browser: ``create_app(cors_origins=[...])`` (``serve
--cors-origin``) answers its preflights and lets it read the answers; a page of any
origin not named is refused as before."""

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import sessionactors as sa
from sessionactors.http import create_app
from sessionactors.testing import EchoModel

from .browser import needs_chromium
from .served import HERE, serve_command
from .servers import Serve
from .wsclient import Closed, open_websocket

APP = "http://localhost:5173"
EVIL = "http://evil.example:666"
SSE = {"accept": "text/event-stream"}


def _vary(response: httpx.Response) -> set[str]:
    return {part.strip().lower() for part in response.headers.get("vary", "").split(",")}


async def test_a_cors_origin_is_answered_its_preflights_and_may_read_the_answers(
    serve: Serve,
) -> None:
    """A page of a named origin sends JSON with the token in ``Authorization`` and a
    message's key in ``Idempotency-Key``, and resumes event streams with
    ``Last-Event-ID``: its preflights (which carry no token) are answered 204 allowing
    those headers and the gateway's methods, for that origin exactly and with credentials, and every answer to it (a reply, an event stream, a
    401, a 404) names the origin, so that the page can read it; every answer varies
    on ``Origin``. Another origin's preflight is refused (403, JSON) and its answers
    name no origin: its page reads nothing, as without CORS."""
    async with (
        serve(token="t0k", cors_origins=[APP + "/"]) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(20):
            asking = {
                "origin": APP,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization,content-type,idempotency-key",
            }
            r = await client.options("/sessions/a/messages", headers=asking)
            assert r.status_code == 204, r.text
            assert r.headers["access-control-allow-origin"] == APP
            assert r.headers["access-control-allow-credentials"] == "true"
            allowed = r.headers["access-control-allow-headers"].lower()
            for header in ("authorization", "content-type", "idempotency-key", "last-event-id"):
                assert header in allowed, allowed
            methods = r.headers["access-control-allow-methods"]
            assert {"GET", "POST", "DELETE"} <= {m.strip() for m in methods.split(",")}
            assert "origin" in _vary(r)
            resume = {**asking, "access-control-request-method": "GET"}
            resume["access-control-request-headers"] = "authorization, last-event-id"
            r = await client.options("/sessions/a/events", headers=resume)
            assert r.status_code == 204, r.text

            page = {"origin": APP, "authorization": "Bearer t0k"}
            r = await client.post("/sessions/a/messages", json={"text": "hi"}, headers=page)
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == APP
            assert r.headers["access-control-allow-credentials"] == "true"
            # (its page may read when a 429 or a 503 says to try again)
            assert r.headers["access-control-expose-headers"] == "Retry-After"
            assert "origin" in _vary(r)
            for refused, headers in [(401, {"origin": APP}), (404, page)]:
                r = await client.get("/sessions/nobody", headers=headers)
                assert r.status_code == refused, r.text
                assert r.headers["access-control-allow-origin"] == APP
            headers = {**page, "last-event-id": "0", **SSE}
            async with client.stream("GET", "/sessions/a/events", headers=headers) as events:
                assert events.status_code == 200
                assert events.headers["access-control-allow-origin"] == APP
            r = await client.get("/sessions/a", headers={"authorization": "Bearer t0k"})
            assert "access-control-allow-origin" not in r.headers
            assert "origin" in _vary(r)

            # another origin: refused as before CORS (its page reads nothing)
            r = await client.options("/sessions/a/messages", headers={**asking, "origin": EVIL})
            assert r.status_code == 403, r.text
            assert r.json()["error"] == "CrossOrigin", r.text
            assert "access-control-allow-origin" not in r.headers
            r = await client.get("/sessions/a", headers={**page, "origin": EVIL})
            assert "access-control-allow-origin" not in r.headers
            assert "access-control-allow-credentials" not in r.headers
            assert "origin" in _vary(r)
            # a header the gateway does not read is not allowed (the answer names it)
            odd = {**asking, "access-control-request-headers": "authorization, x-custom"}
            r = await client.options("/sessions/a/messages", headers=odd)
            assert r.status_code == 403, r.text
            assert "x-custom" in r.json()["message"], r.text


async def test_a_cors_origin_is_trusted_and_any_other_site_still_refused(serve: Serve) -> None:
    """Without a token, a page of a CORS origin is trusted as ``trusted_origins`` are (its
    WebSockets and simple POSTs are not refused), while a page of another site still
    gets 403 ``CrossOrigin`` (4403 for a WebSocket)."""
    async with (
        serve(cors_origins=[APP]) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        ws_url = served.url.replace("http://", "ws://")
        with trio.fail_after(20):
            simple = {"origin": APP, "content-type": "text/plain"}
            r = await client.post("/sessions/m/messages", content=b'{"text": "hi"}', headers=simple)
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == APP
            async with open_websocket(f"{ws_url}/sessions/m/ws?after=0", [("origin", APP)]) as ws:
                assert (await ws.receive())["type"] == "StatusChanged"
            forged = {"origin": EVIL, "content-type": "text/plain"}
            r = await client.post("/sessions/m/messages", content=b'{"text": "x"}', headers=forged)
            assert (r.status_code, r.json()["error"]) == (403, "CrossOrigin"), r.text
            async with open_websocket(f"{ws_url}/sessions/m/ws", [("origin", EVIL)]) as ws:
                frame = await ws.receive()
                assert frame["error"] == "CrossOrigin", frame
                with pytest.raises(Closed) as closed:
                    await ws.receive()
            assert closed.value.code == 4403


async def test_a_header_an_authorize_hook_reads_can_be_allowed_to_cors_pages(
    serve: Serve,
) -> None:
    """An ``authorize`` that reads a header of its own (an API key, a user's id) names
    it in ``cors_headers``: a page of a CORS origin's preflight for it is answered, and
    its request reaches the hook. (It was refused, saying the server reads none such;
    the header is not allowed without it, and any other header is refused still.)"""
    seen: list[str | None] = []

    def authorize(request: Any, session: str | None, action: Any) -> bool:
        seen.append(request.headers.get("x-api-key"))
        return True

    async with (
        serve(authorize=authorize, cors_origins=[APP], cors_headers=["X-API-Key"]) as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(20):
            asking = {
                "origin": APP,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type,x-api-key",
            }
            r = await client.options("/sessions/k/messages", headers=asking)
            assert r.status_code == 204, r.text
            allowed = r.headers["access-control-allow-headers"].lower().split(", ")
            assert "x-api-key" in allowed
            sent = {"origin": APP, "x-api-key": "k-1"}
            r = await client.post("/sessions/k/messages", json={"text": "hi"}, headers=sent)
            assert r.status_code == 200, r.text
            assert "k-1" in seen
            other = {**asking, "access-control-request-headers": "x-other"}
            r = await client.options("/sessions/k/messages", headers=other)
            assert r.status_code == 403, r.text
            assert "cors_headers" in r.json()["message"], r.text


@pytest.mark.parametrize("bad", ["", "X API Key", "x-key:", "x-k\u00e9y", 7])
def test_a_cors_header_that_is_not_a_header_name_is_refused(bad: object) -> None:
    """``cors_headers`` takes header names only: anything else is a ValueError that
    shows it, before the app is made."""
    with pytest.raises(ValueError, match="cors_headers") as refused:
        create_app(agents={"echo": sa.Agent(model=EchoModel())}, cors_headers=[bad])
    assert repr(bad) in str(refused.value)


@pytest.mark.parametrize("bad", ["*", "null", "localhost:5173", "https://app.example.com/ui"])
def test_a_cors_origin_that_is_not_one_is_refused(bad: str) -> None:
    """``cors_origins`` takes exact origins only: a wildcard (which with credentials would
    let every site read a user's sessions), ``null``, a bare host or a path is a
    ValueError that shows one; so is ``serve --cors-origin`` (status 2)."""
    with pytest.raises(ValueError, match=r"https://app\.example\.com") as refused:
        create_app(agents={"echo": sa.Agent(model=EchoModel())}, cors_origins=[bad])
    assert repr(bad) in str(refused.value)
    assert "CORS" in str(refused.value)


def test_serve_refuses_a_cors_origin_that_is_not_one() -> None:
    """``serve --cors-origin '*'`` exits with status 2 and says why."""
    command = [sys.executable, "-m", "sessionactors", "serve", "--store", "memory://"]
    command += ["--agent", "chat_agents:agents", "--cors-origin", "*"]
    done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "CORS origin '*' is not an origin" in done.stderr


# ---- in the browser -----------------------------------------------------------------


@contextmanager
def a_site() -> Iterator[str]:
    """A site of its own origin (``http://localhost:PORT``) serving an empty page: the
    front end of an app that uses the gateway from another origin."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.end_headers()
            self.wfile.write(b"<!doctype html><title>app</title>")

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page) as site:
        threading.Thread(target=site.serve_forever, daemon=True).start()
        try:
            yield f"http://localhost:{site.server_address[1]}"
        finally:
            site.shutdown()


#: Run in a page of another origin: the gateway's JavaScript client, imported from the
#: gateway, sends, streams, lists and resumes a subscription with Last-Event-ID; an
#: EventSource reads the events too. What each gave, or the error it threw.
USE_THE_GATEWAY = """async ([gateway, token]) => {
  const told = {};
  const attempt = async (what, run) => {
    try { told[what] = await run(); } catch (error) { told[what] = `${error.name}: ${error.message}`; }
  };
  let client = null;
  await attempt("import", async () => {
    const { SessionsClient } = await import(`${gateway}/sessionactors.js`);
    client = new SessionsClient({ baseUrl: `${gateway}/`, token });
    return "ok";
  });
  if (!client) return told;
  await attempt("send", async () => (await client.send("far", "hello from afar")).text);
  await attempt("stream", async () => {
    const types = [];
    for await (const event of client.stream("far", "and streamed")) types.push(event.type);
    return types.at(-1);
  });
  await attempt("list", async () => (await client.listSessions()).sessions.map((s) => s.session_id));
  await attempt("subscribe", () => new Promise((resolve) => {
    const texts = [];
    const sub = client.subscribe("far", {
      after: 0,
      onEvent: (event) => {
        if (event.type === "TurnFinished") texts.push(event.message.content);
        if (texts.length === 2) { sub.close(); resolve(texts); }
      },
      onStatus: (status, error) => { if (status === "failed") resolve(`failed: ${error}`); },
    });
  }));
  await attempt("eventsource", () => new Promise((resolve) => {
    const source = new EventSource(`${gateway}/sessions/far/events?after=0&access_token=${token}`);
    source.onmessage = (message) => { source.close(); resolve(JSON.parse(message.data).type); };
    source.onerror = () => { source.close(); resolve("error"); };
  }));
  return told;
}"""


#: A page's fetch of the listing with the token, as a text: what it read, or its error.
FETCH = """async ([gateway, token]) => {
  try {
    const response = await fetch(`${gateway}/sessions`, { headers: { Authorization: `Bearer ${token}` } });
    return `${response.status}`;
  } catch (error) {
    return `${error.name}: ${error.message}`;
  }
}"""


@needs_chromium
def test_a_page_of_a_cors_origin_uses_the_gateway_from_the_browser(
    browser: Any, tmp_path: Path
) -> None:
    """``serve --cors-origin ORIGIN``: a page of that origin imports the gateway's
    JavaScript client from the gateway and sends, streams, lists and resumes with
    ``Last-Event-ID`` (the token in a header: every call preflighted), and reads the
    events with an ``EventSource``; a page of an origin not named gets nothing."""
    with a_site() as app, a_site() as other:
        store = f"sqlite:///{tmp_path / 'cors.db'}"
        with serve_command(store, "--token", "tok", "--cors-origin", app) as server:
            page = browser.new_page()
            page.goto(f"{app}/")
            told = page.evaluate(USE_THE_GATEWAY, [server.url, "tok"])
            page.close()
            assert told == {
                "import": "ok",
                "send": "hello from afar",
                "stream": "TurnFinished",
                "list": ["far"],
                "subscribe": ["hello from afar", "and streamed"],
                "eventsource": "StatusChanged",
            }, told

            page = browser.new_page()
            page.goto(f"{other}/")
            told = page.evaluate(USE_THE_GATEWAY, [server.url, "tok"])
            assert told["import"].startswith("TypeError"), told  # (nothing else ran)
            fetched = page.evaluate(FETCH, [server.url, "tok"])
            assert fetched.startswith("TypeError"), fetched
            page.close()
            r = httpx.get(f"{server.url}/sessions", headers={"authorization": "Bearer tok"})
            assert [s["session_id"] for s in r.json()["sessions"]] == ["far"]
