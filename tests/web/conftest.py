"""The gateway tests' ``serve`` fixture: the app on each real server in turn; and the
pages' ``browser``."""

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from sessionactors.http import create_app

from .browser import BROWSER_ARGS, CHROMIUM
from .chat_agents import asyncio_agents, trio_agents
from .servers import Serve, Served, serve_asyncio, serve_trio


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A slow test marked ``one_server`` runs on hypercorn's trio worker in ``make test``
    and on the other servers too in ``make soak``."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (
            item.get_closest_marker("one_server") is not None
            and callspec is not None
            and callspec.params.get("serve", "hypercorn-trio") != "hypercorn-trio"
        ):
            item.add_marker(pytest.mark.soak)


@pytest.fixture(params=["hypercorn-trio", "uvicorn-asyncio"])
def serve(request: pytest.FixtureRequest) -> Serve:
    """``serve(**create_app_options)``: the app, opened in its lifespan, on a real server
    (``wrap=``: an ASGI app around it, which the server runs instead)."""
    kind: str = request.param

    @asynccontextmanager
    async def start(
        *, delay: float = 0.02, wrap: Callable[[Any], Any] | None = None, **options: Any
    ) -> AsyncIterator[Served]:
        trio_side = kind == "hypercorn-trio"
        agents = trio_agents(delay) if trio_side else asyncio_agents(delay)
        app = create_app(agents=agents, **options)
        served = app if wrap is None else wrap(app)
        async with (serve_trio if trio_side else serve_asyncio)(served) as url:
            yield Served(url, app, kind)

    return start


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module (its tests are marked ``needs_chromium``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            yield browser
        finally:
            browser.close()
