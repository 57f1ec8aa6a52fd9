"""The chat page and the gateway as a browser meets them, probed by a user and by an
attacker: another site's page must not act on a user's sessions, markup in any text
never runs, and the page's routing and token handling hold at the edges."""

from typing import Any

import httpx
import pytest
import trio

from .servers import Serve
from .wsclient import Closed, open_websocket

EVIL = "http://evil.example:666"


async def test_another_sites_page_cannot_post_a_simple_request(serve: Serve) -> None:
    """A page of another site can send a "simple" cross-origin POST (text/plain, no
    preflight) to a gateway on the user's machine or network: it must not create a
    session, send a message, approve a review or cancel a turn (cross-site request
    forgery). The same request from the gateway's own page, or from a client that is
    no browser (no Origin), still works."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        with trio.fail_after(20):
            r = await client.post("/sessions/shop/messages", json={"text": "refund C3"})
            [pending] = (await client.get("/sessions/shop")).json()["pending_reviews"]
            forged: dict[str, Any] = {"headers": {"content-type": "text/plain", "origin": EVIL}}
            r = await client.post(
                "/sessions/csrf/messages", content=b'{"text": "from evil"}', **forged
            )
            assert r.status_code == 403, r.text
            assert r.json()["error"] == "CrossOrigin"
            assert "csrf" in r.json()["message"]
            r = await client.post(
                f"/sessions/shop/reviews/{pending['id']}",
                content=b'{"approve": true}',
                **forged,
            )
            assert r.status_code == 403, r.text
            r = await client.post("/sessions/shop/cancel", **forged)
            assert r.status_code == 403, r.text
            assert (await client.get("/sessions/csrf")).status_code == 404
            state = (await client.get("/sessions/shop")).json()
            assert len(state["pending_reviews"]) == 1
            # the gateway's own page, and a client with no Origin, are not refused
            same = {"origin": served.url, "content-type": "text/plain"}
            r = await client.post("/sessions/ok/messages", content=b'{"text": "a"}', headers=same)
            assert r.status_code == 200, r.text
            r = await client.post("/sessions/ok/messages", content=b'{"text": "b"}')
            assert r.status_code == 200, r.text
            # a cross-origin request a browser preflights (JSON) is CORS's business
            r = await client.post(
                "/sessions/ok/messages", json={"text": "c"}, headers={"origin": EVIL}
            )
            assert r.status_code == 200, r.text


async def test_another_sites_page_cannot_open_a_websocket(serve: Serve) -> None:
    """Browsers apply no CORS to WebSockets: any site's page can open one to a gateway
    the user reaches, and read every event of a session and send to it (cross-site
    WebSocket hijacking). A WebSocket whose Origin is another site is refused (4403)
    before it reads or writes anything; one from the gateway's own page is not."""
    async with serve() as served, httpx.AsyncClient(base_url=served.url) as client:
        ws_url = served.url.replace("http://", "ws://")
        with trio.fail_after(20):
            r = await client.post("/sessions/private/messages", json={"text": "my secret"})
            assert r.status_code == 200, r.text
            async with open_websocket(
                f"{ws_url}/sessions/private/ws?after=0", [("origin", EVIL)]
            ) as ws:
                frame = await ws.receive()
                assert (frame["type"], frame["error"]) == ("error", "CrossOrigin"), frame
                with pytest.raises(Closed) as closed:
                    await ws.receive()  # not the session's events
            assert closed.value.code == 4403
            async with open_websocket(f"{ws_url}/sessions/hijacked/ws", [("origin", EVIL)]) as ws:
                frames = await _until_closed(ws)
                assert [f["error"] for f in frames] == ["CrossOrigin"], frames
            assert (await client.get("/sessions/hijacked")).status_code == 404
            async with open_websocket(
                f"{ws_url}/sessions/private/ws?after=0", [("origin", served.url)]
            ) as ws:
                frame = await ws.receive()
                assert (frame["type"], frame["seq"]) == ("StatusChanged", 1), frame


async def test_another_sites_page_with_the_token_may_open_a_websocket(serve: Serve) -> None:
    """A page elsewhere that holds the token (an app served from another origin) proves
    itself with it, as a page of another site cannot: its WebSocket is not refused."""
    async with serve(token="t0k") as served:
        ws_url = served.url.replace("http://", "ws://")
        with trio.fail_after(20):
            async with open_websocket(
                f"{ws_url}/sessions/mine/ws?access_token=t0k", [("origin", EVIL)]
            ) as ws:
                await ws.send({"type": "message", "text": "hi"})
                assert (await ws.receive())["type"] != "error"


async def _until_closed(ws: Any) -> list[dict[str, Any]]:
    """The frames a WebSocket receives until the server closes it."""
    frames: list[dict[str, Any]] = []
    while True:
        try:
            frames.append(await ws.receive())
        except Closed:
            return frames
