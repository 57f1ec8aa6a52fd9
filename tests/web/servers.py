"""Real servers on 127.0.0.1 for the gateway tests: hypercorn's trio worker in the test's
trio run, and uvicorn on an asyncio loop in a thread of its own."""

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import trio
import uvicorn

from sessionactors.http import SessionsApp


@asynccontextmanager
async def serve_trio(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with hypercorn's trio worker in this trio run; its base URL."""
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 5
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = functools.partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait)
        with trio.fail_after(10):
            binds = await nursery.start(serve)
        try:
            yield binds[0]
        finally:
            stop.set()


@asynccontextmanager
async def serve_asyncio(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on an asyncio loop in another thread; its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # told to the test below
            failed.append(exc)

    thread = threading.Thread(target=run, name="uvicorn")
    thread.start()
    try:
        with trio.fail_after(10):
            while not server.started:
                if not thread.is_alive():
                    raise RuntimeError(f"uvicorn did not start: {failed}")
                await trio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with trio.fail_after(30):
            await trio.to_thread.run_sync(thread.join)
    if failed:
        raise failed[0]


@attrs.frozen
class Served:
    """An app on a real server: its base URL, the app, and which server ("hypercorn-trio"
    or "uvicorn-asyncio")."""

    url: str
    app: SessionsApp
    kind: str

    def registry(self) -> Any:
        assert self.app.registry is not None
        return self.app.registry


Serve = Callable[..., AbstractAsyncContextManager[Served]]
