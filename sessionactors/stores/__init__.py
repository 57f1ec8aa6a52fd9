"""Stores: where sessions are kept durable.

A store deals in bytes: ``dump_events`` / ``load_events`` are the codec of a
journal entry (the events of one commit), ``dump_info`` / ``load_info`` of a
session's info, as ``sessionactors.dump_snapshot`` / ``load_snapshot`` are of
a snapshot, for store authors and for inspection; ``info_activity`` reads the
activity time that a paged listing (``PagedStore.list_page``) orders by and
``IdlePageStore.list_idle_page`` starts at. ``MAX_SNAPSHOT_BYTES`` and
``MAX_JOURNAL_ENTRY_BYTES`` are the sizes the codec writes and reads, and
``MAX_SEQ`` the largest seq (and count) a record holds: a store refuses to
write a seq above it, and takes one read back above it for damage.

``MemoryStore`` and ``SQLiteStore`` need nothing beyond the core
dependencies; ``RedisStore`` needs the ``redis`` extra (coredis) and is
imported on first use.
"""

from typing import TYPE_CHECKING, Any

from .._codec import MAX_JOURNAL_ENTRY_BYTES as MAX_JOURNAL_ENTRY_BYTES
from .._codec import MAX_SEQ as MAX_SEQ
from .._codec import MAX_SNAPSHOT_BYTES as MAX_SNAPSHOT_BYTES
from .._codec import dump_events as dump_events
from .._codec import dump_info as dump_info
from .._codec import load_events as load_events
from .._codec import load_info as load_info
from .._listing import info_activity as info_activity
from ._base import IdlePageStore as IdlePageStore
from ._base import JournalEntry as JournalEntry
from ._base import JournalPageStore as JournalPageStore
from ._base import Lease as Lease
from ._base import LeaseBatchStore as LeaseBatchStore
from ._base import PagedStore as PagedStore
from ._base import Store as Store
from ._base import StoredSession as StoredSession

if TYPE_CHECKING:
    from ._memory import MemoryStore as MemoryStore
    from ._redis import RedisStore as RedisStore
    from ._sqlite import SQLiteStore as SQLiteStore
    from ._sqlite import SQLiteStoreStatistics as SQLiteStoreStatistics

__all__ = [  # noqa: RUF022 (sorted plainly, as tests/test_public_api.py checks)
    "IdlePageStore",
    "JournalEntry",
    "JournalPageStore",
    "Lease",
    "LeaseBatchStore",
    "MAX_JOURNAL_ENTRY_BYTES",
    "MAX_SEQ",
    "MAX_SNAPSHOT_BYTES",
    "MemoryStore",
    "PagedStore",
    "RedisStore",
    "SQLiteStore",
    "SQLiteStoreStatistics",
    "Store",
    "StoredSession",
    "dump_events",
    "dump_info",
    "info_activity",
    "load_events",
    "load_info",
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
