"""Asyncio models and tools as trio ones: each runs in an asyncio task of the host loop.

A model's ``stream(request)`` runs, from its first chunk to its last, in one
asyncio task (so that ``asyncio.timeout``, anyio cancel scopes and an
``AsyncOpenAI`` client's streaming response behave as they do in any asyncio
program); its chunks cross to the session's trio task through a small
bounded buffer. A tool's coroutine runs in an asyncio task of its own; a plain
function runs in a worker thread, as under trio (an awaitable it returns, in an
asyncio task).
Cancelling the turn in trio cancels the asyncio task and waits for it to end.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Final, TypeVar

import attrs
import trio

import sessionactors as sa

from .._tools import adapted, is_async_callable, run_in_thread
from ._host import Host, task_result, wait_asyncio

__all__ = ["adapt_agent", "trio_native"]

T = TypeVar("T")

#: Chunks a model may stream ahead of the session reading them.
_CHUNKS_AHEAD: Final = 64

_TRIO_NATIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def trio_native(obj: T) -> T:
    """Mark a model, a model class or a tool function as trio code, and return it.

    Under :func:`sessionactors.aio.open_registry`, models and tool functions are
    taken to be asyncio code and run in asyncio tasks, except the library's own
    test models (``sessionactors.testing``) and those marked here, which run in
    the trio run as they would under ``sessionactors.open_registry``. The models
    of ``sessionactors.models`` run on asyncio too (they are anyio code), so that
    an ``httpx.AsyncClient`` the app shares with them stays on one loop.
    """
    try:
        _TRIO_NATIVE.add(obj)
    except TypeError:
        raise TypeError(
            f"trio_native() cannot mark {obj!r}: it takes no weak reference; mark its class instead"
        ) from None
    return obj


def _is_trio_native(obj: Any) -> bool:
    target = getattr(obj, "__func__", obj)  # a bound method: its function
    for candidate in (target, type(target)):
        try:
            if candidate in _TRIO_NATIVE:
                return True
        except TypeError:  # unhashable, or no weak reference
            pass
    if inspect.isfunction(target) or inspect.ismethod(target):
        module = getattr(target, "__module__", None) or ""
    else:
        module = type(target).__module__
    if module == "sessionactors.models" or module.startswith("sessionactors.models."):
        # anyio code: on asyncio, with the app's clients, whose pools belong to its loop
        return False
    return module == "sessionactors" or module.startswith("sessionactors.")


def adapt_agent(host: Host, agent: sa.Agent) -> sa.Agent:
    """The agent with its asyncio model, summarizer and tools running on ``host``'s loop."""
    model = agent.model if _is_trio_native(agent.model) else AsyncioModel(agent.model, host)
    compaction = agent.compaction
    if compaction is not None and compaction.summarizer is not None:
        summarizer = compaction.summarizer
        if not _is_trio_native(summarizer):
            compaction = attrs.evolve(compaction, summarizer=AsyncioModel(summarizer, host))
    tools = tuple(_adapt_tool(host, t) for t in agent.tools)
    return attrs.evolve(agent, model=model, tools=tools, compaction=compaction)


def _adapt_tool(host: Host, tool: Any) -> Any:
    if not isinstance(tool, sa.Tool) or _is_trio_native(tool.fn):
        return tool
    fn = tool.fn
    in_thread = not is_async_callable(fn)  # (a plain function: in a worker thread, as in trio)

    @functools.wraps(fn)
    async def on_asyncio(**kwargs: Any) -> Any:
        result = await run_in_thread(fn, kwargs) if in_thread else fn(**kwargs)
        if inspect.isawaitable(result):
            return await wait_asyncio(host, result)
        await trio.lowlevel.checkpoint()
        return result

    return adapted(tool, on_asyncio)  # (its schema and context read from its own fn)


@attrs.define(eq=False)
class AsyncioModel:
    """A model whose ``stream`` is asyncio code, seen from trio."""

    model: Any
    host: Host

    def __repr__(self) -> str:
        return f"<asyncio model {self.model!r}>"

    def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        """Stream the asyncio model's answer into the session's trio task."""
        return _ChunkStream(self.host, self.model, request)


class _ChunkStream:
    """Chunks an asyncio task produces and a trio task reads (one producer, one reader)."""

    def __init__(self, host: Host, model: Any, request: sa.ModelRequest) -> None:
        self._host = host
        self._model = model
        self._request = request
        self._chunks: deque[sa.ModelChunk] = deque()
        self._task: asyncio.Task[None] | None = None
        self._reader: trio.Event | None = None  # set when the trio reader waits
        self._room: asyncio.Future[None] | None = None  # set when the producer waits
        self._gone = trio.Event()  # the producer task has ended

    def __aiter__(self) -> _ChunkStream:
        return self

    async def __anext__(self) -> sa.ModelChunk:
        if self._task is None:
            self._task = self._host.loop.create_task(self._produce())
            self._host.tasks.add(self._task)  # (see _host._take_interrupts)
            self._task.add_done_callback(lambda _: self._host.run_sync_soon(self._on_gone))
        if self._chunks:
            await trio.lowlevel.checkpoint()  # before taking: a cancelled read loses nothing
        while not self._chunks:
            if self._gone.is_set():
                task_result(self._task)  # the model's exception, as itself
                raise StopAsyncIteration
            self._reader = reader = trio.Event()
            try:
                await reader.wait()
            finally:
                self._reader = None
        chunk = self._chunks.popleft()
        room = self._room
        if room is not None and len(self._chunks) < _CHUNKS_AHEAD // 2:
            self._room = None
            if not room.done():
                room.set_result(None)
        return chunk

    async def _produce(self) -> None:
        stream = self._model.stream(self._request)
        try:
            async for chunk in stream:
                self._chunks.append(chunk)
                self._wake_reader()
                while len(self._chunks) >= _CHUNKS_AHEAD:
                    self._room = self._host.loop.create_future()
                    await self._room
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def _wake_reader(self) -> None:
        reader = self._reader
        if reader is not None:
            self._reader = None
            self._host.run_sync_soon(reader.set)

    def _on_gone(self) -> None:  # in trio, once the producer task has ended
        self._gone.set()
        reader = self._reader
        if reader is not None:
            self._reader = None
            reader.set()

    async def aclose(self) -> None:
        """Stop the asyncio producer (cancelling it) and wait until it has ended.

        A model whose stream raised as it closed raises that here, as a trio model's
        stream would from ``aclose``.
        """
        task = self._task
        if task is None or self._gone.is_set():
            if task is not None and not task.cancelled():
                task.exception()  # read: the reader stopped early, for its own reason
            await trio.lowlevel.checkpoint()
            return
        cancelling = task.cancel()  # (False: it had just ended by itself)
        await self._gone.wait()
        if not task.cancelled():
            error = task.exception()  # (read, whatever comes of it)
            if cancelling and error is not None:
                raise error
