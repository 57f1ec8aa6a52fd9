"""Stores: where sessions are kept durable.

``MemoryStore`` and ``SQLiteStore`` need nothing beyond the core
dependencies; ``RedisStore`` needs the ``redis`` extra (coredis) and is
imported on first use.
"""

from typing import TYPE_CHECKING, Any

from ._base import JournalEntry as JournalEntry
from ._base import Lease as Lease
from ._base import Store as Store
from ._base import StoredSession as StoredSession

if TYPE_CHECKING:
    from ._memory import MemoryStore as MemoryStore
    from ._redis import RedisStore as RedisStore
    from ._sqlite import SQLiteStore as SQLiteStore
    from ._sqlite import SQLiteStoreStatistics as SQLiteStoreStatistics

__all__ = [
    "JournalEntry",
    "Lease",
    "MemoryStore",
    "RedisStore",
    "SQLiteStore",
    "SQLiteStoreStatistics",
    "Store",
    "StoredSession",
]

_LAZY = {
    "MemoryStore": "_memory",
    "SQLiteStore": "_sqlite",
    "SQLiteStoreStatistics": "_sqlite",
    "RedisStore": "_redis",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sessionactors.stores' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
