"""sessionactors from asyncio: the same registry, refs, records, events and errors.

``async with sessionactors.aio.open_registry(...) as registry:`` inside a
running asyncio loop (``asyncio.run``, uvicorn, FastAPI, Starlette). The
registry runs in trio's guest mode on that loop's thread; the agents' asyncio
models and tools run as asyncio tasks of the same loop.
"""

from ._adapters import trio_native as trio_native
from ._registry import EventStream as EventStream
from ._registry import Registry as Registry
from ._registry import SessionRef as SessionRef
from ._registry import Turn as Turn
from ._registry import open_registry as open_registry

__all__ = ["EventStream", "Registry", "SessionRef", "Turn", "open_registry", "trio_native"]
