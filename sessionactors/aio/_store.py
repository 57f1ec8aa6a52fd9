"""Stores written on an asyncio client (asyncpg, redis.asyncio, motor), seen from trio.

The registry calls its store from trio code, so a store is trio code unless it is
wrapped: :func:`asyncio_store` runs each call of the wrapped store's methods as an
asyncio task of the loop whose ``sessionactors.aio`` trio run makes the call (the loop
of the registry that uses it), and waits for it in trio (``wait_asyncio``): a
cancellation in trio cancels the task. A registry shields the writes that must not
be cut half-way, so those run to their end. The wrapper has the optional methods of
``PagedStore``, ``IdlePageStore``, ``LeaseBatchStore`` and ``JournalPageStore`` only
when the wrapped store has them, so that ``isinstance`` checks of those protocols answer as for the
store itself. Called in any other trio run, it sends nothing and raises
``StoreConfigurationError`` (``aclose`` does nothing there).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import trio

from .._errors import StoreConfigurationError
from ..stores._base import JournalEntry, Lease, Store, StoredSession
from ._host import acquire_host, current_host, release_host, wait_asyncio

__all__ = ["asyncio_store", "check_store"]

T = TypeVar("T")

#: The methods of the optional store protocols, each of which the wrapper has only if
#: the wrapped store has it.
_OPTIONAL: Final = ("list_page", "list_idle_page", "renew_many", "read_journal_page")


def asyncio_store(store: Any) -> Store:
    """Wrap a store whose methods are asyncio code, for :func:`open_registry`.

    A store's methods are called from the registry's trio code, so a store built on
    an asyncio client (asyncpg, ``redis.asyncio``, motor) fails there (trio's
    ``TypeError: trio.run received unrecognized yield message``). Wrapped, each
    call runs the store's coroutine as an asyncio task of the loop of the
    ``sessionactors.aio`` registry that uses it; cancelling the call in trio (a
    cancelled turn, the registry closing) cancels the task, except for the writes
    that a registry shields so that they are never cut half-way::

        store = sessionactors.aio.asyncio_store(PostgresStore(pool))
        async with sessionactors.aio.open_registry(store=store, agents=agents) as registry:
            ...

    The wrapper has the Store protocol's methods, and ``list_page``,
    ``list_idle_page``, ``renew_many`` and ``read_journal_page`` only when ``store``
    has them (so it is a ``PagedStore``, ``IdlePageStore``, ``LeaseBatchStore`` or
    ``JournalPageStore`` as ``store`` is); its ``shared_by_workers`` and
    ``writes_to`` are the store's.
    Every method of ``store`` must be asyncio code: a trio store
    (``sessionactors.SQLiteStore``, a store whose methods await ``trio`` functions)
    is passed as it is: wrapping one of the library's raises ``TypeError``, and a
    wrapped store of your own that awaits trio fails its first call with
    ``StoreConfigurationError`` saying so. Check
    it with ``sessionactors.aio.check_store``. Used by a registry of
    ``sessionactors.open_registry`` (a plain trio run, with no asyncio loop), every
    call raises ``StoreConfigurationError`` and sends nothing to the store (but
    ``aclose``, which does nothing there, so that the registry's close adds no
    second error).
    """
    if isinstance(store, AsyncioStore):
        return store
    module = type(store).__module__
    if module == "sessionactors" or module.startswith("sessionactors."):
        raise TypeError(
            f"asyncio_store() wraps a store written for asyncio, and {type(store).__name__} "
            "is trio code, as every store of sessionactors is: pass it to open_registry "
            "as it is"
        )
    methods = [n for n, v in vars(Store).items() if callable(v) and not n.startswith("_")]
    missing = sorted(n for n in methods if not callable(getattr(store, n, None)))
    if missing:
        raise TypeError(
            f"asyncio_store() takes a store: {type(store).__name__} lacks "
            f"{', '.join(missing)} (see sessionactors.stores.Store)"
        )
    present = tuple(callable(getattr(store, name, None)) for name in _OPTIONAL)
    wrapper: Store = _wrapper_class(present)(store)
    return wrapper


class AsyncioStore:
    """A store whose methods are asyncio code, called from trio (see ``asyncio_store``)."""

    __slots__ = ("_store",)

    def __init__(self, store: Any) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"<asyncio store {self._store!r}>"

    @property
    def shared_by_workers(self) -> bool:
        """The wrapped store's (whether registries take leases on it by default)."""
        return bool(getattr(self._store, "shared_by_workers", False))

    @property
    def writes_to(self) -> object:
        """The wrapped store's (what one registry without leases writes alone)."""
        return getattr(self._store, "writes_to", None)

    async def _run(self, session_id: str | None, name: str, *args: Any, **kwargs: Any) -> Any:
        host = current_host()
        if host is None:
            raise _outside_error(self._store, session_id)
        try:
            return await wait_asyncio(host, getattr(self._store, name)(*args, **kwargs))
        except RuntimeError as exc:
            if not _trio_in_asyncio(exc):
                raise
            raise _trio_code_error(self._store, name, session_id) from exc

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self._run(session_id, "create", session_id, snapshot, info)

    async def load(self, session_id: str) -> StoredSession | None:
        loaded: StoredSession | None = await self._run(session_id, "load", session_id)
        return loaded

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._run(session_id, "append", session_id, entries, info, fence=fence)

    async def write_snapshot(
        self,
        session_id: str,
        snapshot: bytes,
        seq: int,
        info: bytes,
        *,
        trim_upto: int,
        fence: int | None = None,
    ) -> None:
        await self._run(
            session_id,
            "write_snapshot",
            session_id,
            snapshot,
            seq,
            info,
            trim_upto=trim_upto,
            fence=fence,
        )

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        read: tuple[int, list[JournalEntry]] = await self._run(
            session_id, "read_journal", session_id, after
        )
        return read

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        listed: list[tuple[str, bytes]] = await self._run(None, "list_sessions")
        return listed

    async def exists(self, session_id: str) -> bool:
        return bool(await self._run(session_id, "exists", session_id))

    async def delete(self, session_id: str) -> bool:
        return bool(await self._run(session_id, "delete", session_id))

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        lease: Lease | None = await self._run(session_id, "claim", session_id, owner, ttl)
        return lease

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        return bool(await self._run(session_id, "renew", session_id, lease, ttl))

    async def release(self, session_id: str, lease: Lease) -> None:
        await self._run(session_id, "release", session_id, lease)

    async def aclose(self) -> None:
        if current_host() is None:  # nothing reached the store here: nothing to close
            await trio.lowlevel.checkpoint()
            return
        await self._run(None, "aclose")


class _ListPage(AsyncioStore):
    __slots__ = ()

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        page: list[tuple[str, bytes]] = await self._run(
            after, "list_page", after=after, limit=limit
        )
        return page


class _ListIdlePage(AsyncioStore):
    __slots__ = ()

    async def list_idle_page(
        self, *, active_before: int, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        page: list[tuple[str, bytes]] = await self._run(
            after, "list_idle_page", active_before=active_before, after=after, limit=limit
        )
        return page


class _RenewMany(AsyncioStore):
    __slots__ = ()

    async def renew_many(self, leases: Mapping[str, Lease], ttl: float) -> set[str]:
        lost: set[str] = await self._run(None, "renew_many", leases, ttl)
        return lost


class _ReadJournalPage(AsyncioStore):
    __slots__ = ()

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        page: tuple[int, list[JournalEntry]] = await self._run(
            session_id, "read_journal_page", session_id, after, limit=limit, max_bytes=max_bytes
        )
        return page


_MIXINS: Final = (_ListPage, _ListIdlePage, _RenewMany, _ReadJournalPage)


@functools.cache
def _wrapper_class(present: tuple[bool, ...]) -> type[AsyncioStore]:
    """The wrapper class with the optional methods marked ``present`` (in _OPTIONAL's order)."""
    bases = tuple(mixin for mixin, has in zip(_MIXINS, present, strict=True) if has)
    if not bases:
        return AsyncioStore
    return type("AsyncioStore", bases, {"__slots__": (), "__doc__": AsyncioStore.__doc__})


def _outside_error(store: Any, session_id: str | None) -> StoreConfigurationError:
    about = f"session {session_id!r}: " if session_id is not None else ""
    return StoreConfigurationError(
        f"{about}the store {store!r} is asyncio code (wrapped by "
        "sessionactors.aio.asyncio_store) and was called outside a trio run of "
        "sessionactors.aio, where it has no asyncio loop to run on; nothing was sent to "
        "it. Open its registry with sessionactors.aio.open_registry(store=...) inside the "
        "asyncio loop, and check it with sessionactors.aio.check_store",
        session_id=session_id,
    )


def _trio_in_asyncio(error: RuntimeError) -> bool:
    """Whether ``error`` is what trio code run as an asyncio task raises: asyncio's
    refusal of a trio trap, or trio's of a call outside a trio run."""
    said = str(error)
    return said.startswith("Task got bad yield: <class 'trio.") or (
        said == "must be called from async context"
    )


def _trio_code_error(store: Any, method: str, session_id: str | None) -> StoreConfigurationError:
    about = f"session {session_id!r}: " if session_id is not None else ""
    return StoreConfigurationError(
        f"{about}the store {store!r}, wrapped by sessionactors.aio.asyncio_store, awaited "
        f"trio code in its {method}(), as a store written for trio does; asyncio_store "
        "runs a store's calls on the asyncio loop. Pass a store written for trio to "
        "open_registry unwrapped (sessionactors.aio.open_registry takes it as it is)",
        session_id=session_id,
    )


async def check_store(
    make_store: Callable[[], Store | Awaitable[Store]],
    *,
    reopen: Callable[[Store], Store | Awaitable[Store]] | None = None,
) -> None:
    """Run the conformance suite of ``sessionactors.testing.check_store`` from asyncio.

    For a store on an asyncio client, wrapped by :func:`asyncio_store`; await it in
    an asyncio test (``asyncio.run``, pytest-asyncio, anyio's asyncio backend)::

        async def test_my_store_conforms() -> None:
            async with asyncio.timeout(30):
                await sessionactors.aio.check_store(
                    lambda: sessionactors.aio.asyncio_store(MyStore(...))
                )

    The suite runs in the trio run that ``sessionactors.aio`` keeps on the running
    loop (started for it if no registry has). ``make_store()`` may return a store,
    or an asyncio awaitable of one (``async def make(): return
    asyncio_store(MyStore(await asyncpg.create_pool(...)))``), awaited on the loop;
    so may ``reopen(store)``, which makes a second store over the data of ``store``
    (see ``sessionactors.testing.check_store``). Its failures and its time are those
    of ``sessionactors.testing.check_store``; cancelling the caller
    (``asyncio.timeout``) cancels the suite.
    """
    from ..testing import check_store as check  # (the test kit, a plug-in beside this one)

    host = await acquire_host()
    try:

        async def made(store: Store | Awaitable[Store]) -> Store:
            if inspect.isawaitable(store):
                done: Store = await wait_asyncio(host, store)
                return done
            return store

        async def make() -> Store:
            return await made(make_store())

        async def again(store: Store) -> Store:
            assert reopen is not None
            return await made(reopen(store))

        await host.call(functools.partial(check, make, reopen=None if reopen is None else again))
    finally:
        await release_host(host)
