"""The gateway as a newcomer first serves it: inside an app of their own."""

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.routing import Mount

from sessionactors.http import create_app

from .chat_agents import asyncio_agents, trio_agents
from .servers import serve_asyncio, serve_trio


@pytest.mark.parametrize("kind", ["hypercorn-trio", "uvicorn-asyncio"])
async def test_a_mounted_app_whose_lifespan_never_ran_says_so(kind: str) -> None:
    """create_app(agents=...) mounted inside another app gets no lifespan events, so it
    never opens its registry: its requests are answered 500 with a message that says
    why and what to do, not 503 "shutting down", which a client retries for ever."""
    trio_side = kind == "hypercorn-trio"
    gateway = create_app(agents=trio_agents(0.0) if trio_side else asyncio_agents(0.0))
    outer = Starlette(routes=[Mount("/api", gateway)])
    async with (serve_trio if trio_side else serve_asyncio)(outer) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(20):
                r = await client.post("/api/sessions/ada/messages", json={"text": "hi"})
    assert r.status_code == 500, r.text
    body = r.json()
    assert body["error"] == "NoRegistry"
    assert "lifespan" in body["message"]
    assert "create_app(registry)" in body["message"]
    assert "shutting down" not in body["message"]
