"""sessionactors from asyncio: the same registry, refs, records, events and errors.

``async with sessionactors.aio.open_registry(...) as registry:`` inside a
running asyncio loop (``asyncio.run``, uvicorn, FastAPI, Starlette). The
registry runs in trio's guest mode on that loop's thread; the agents' asyncio
models and tools run as asyncio tasks of the same loop. A store is trio code,
unless wrapped by ``asyncio_store``: then its calls run as asyncio tasks too
(``check_store`` checks one from asyncio).
"""

from ._adapters import trio_native as trio_native
from ._registry import EventStream as EventStream
from ._registry import Registry as Registry
from ._registry import SessionRef as SessionRef
from ._registry import Turn as Turn
from ._registry import open_registry as open_registry
from ._store import asyncio_store as asyncio_store
from ._store import check_store as check_store

__all__ = [
    "EventStream",
    "Registry",
    "SessionRef",
    "Turn",
    "asyncio_store",
    "check_store",
    "open_registry",
    "trio_native",
]
