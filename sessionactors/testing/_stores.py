"""Stores for tests: wrappers that stall, fail or break another store on purpose.

``FaultyStore`` keeps the store contract and injects the faults a real store
has (a write that hangs, a write that fails), when and where a test asks.
``FlawedStore`` breaks the contract (it loses or reorders what it was given):
it is the negative control of a durability test, which must fail with it.
Both wrap any :class:`~sessionactors.stores.Store` and forward every call to it;
both read its journal in pages (each is a ``JournalPageStore``), with its own
``read_journal_page``, or cut from ``read_journal`` if it has none.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Sequence
from typing import ClassVar, Final

import attrs
import trio

from .._errors import StoreError
from ..stores._base import JournalEntry, JournalPageStore, Lease, Store, StoredSession
from ..stores._memory import MemoryStore, _page

__all__ = ["FaultyStore", "FlawedStore", "Gate"]

#: The methods of the :class:`~sessionactors.stores.Store` protocol.
_OPERATIONS: Final = (
    "create",
    "load",
    "append",
    "write_snapshot",
    "read_journal",
    "list_sessions",
    "exists",
    "delete",
    "claim",
    "renew",
    "release",
    "aclose",
)


def _store_or_memory(store: Store | None) -> Store:
    return MemoryStore() if store is None else store


async def _read_page(
    store: Store, session_id: str, after: int, limit: int, max_bytes: int
) -> tuple[int, list[JournalEntry]]:
    """A page of the journal of ``store``: its own, or cut from ``read_journal`` if it
    reads no pages."""
    if isinstance(store, JournalPageStore):
        return await store.read_journal_page(session_id, after, limit=limit, max_bytes=max_bytes)
    trimmed, entries = await store.read_journal(session_id, after)
    return trimmed, _page(entries[: max(limit, 1)], max_bytes)


def _check_operation(operation: str) -> None:
    if operation not in _OPERATIONS:
        raise ValueError(
            f"{operation!r} is not a store operation; use one of {', '.join(_OPERATIONS)}"
        )


# ---- FaultyStore -------------------------------------------------------------------


@attrs.define(eq=False, repr=False)
class Gate:
    """Holds whoever waits at it until it is opened, from any thread or loop.

    ``FaultyStore.hold`` makes one that holds the calls of a store operation. Make
    one yourself (``Gate()``) to hold a fake model's answer: a
    ``Scripted(wait=gate)`` waits at it. Either way ``gate.open()`` lets them go on,
    and may be called from anywhere: from trio code, from asyncio code, or from a
    sync test whose app runs in another thread (Starlette's ``TestClient`` runs the
    app's loop, and the trio run of ``sessionactors.aio`` on it, in a thread of its own).

    ``waiting`` is the number held at the gate now; ``held`` the number held so
    far, in all (one that came after it opened was not held).
    """

    operation: str | None = None
    session_id: str | None = attrs.field(default=None, kw_only=True)
    after: bool = attrs.field(default=False, kw_only=True)
    waiting: int = attrs.field(default=0, init=False)
    held: int = attrs.field(default=0, init=False)
    _open: bool = attrs.field(default=False, init=False)
    # The waiters' trio runs, each with the event its waiters wait on; a lock, since
    # open() may come from another thread while a waiter arrives.
    _events: dict[trio.lowlevel.TrioToken, trio.Event] = attrs.field(factory=dict, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def __repr__(self) -> str:
        state = "open" if self.is_open else f"holding {self.waiting}"
        if self.operation is None:
            return f"<Gate {state}>"
        return f"<Gate {self.operation} session_id={self.session_id!r} {state}>"

    @property
    def is_open(self) -> bool:
        """Whether ``open()`` was called."""
        return self._open

    def open(self) -> None:
        """Let the held go on, and hold no more. Opening twice does nothing.

        It may be called from any thread, trio run or asyncio loop."""
        with self._lock:
            self._open = True
            events, self._events = self._events, {}
        try:
            trio.lowlevel.current_task()
            here: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:  # (not in a trio task: another thread, asyncio code)
            here = None
        for token, event in events.items():
            if token is here:
                event.set()
                continue
            with contextlib.suppress(trio.RunFinishedError):  # (nobody waits there any more)
                token.run_sync_soon(event.set)

    async def wait(self) -> None:
        """Wait (in trio code) until the gate is open; at once if it is."""
        token = trio.lowlevel.current_trio_token()
        with self._lock:
            event = None if self._open else self._events.setdefault(token, trio.Event())
        if event is None:
            await trio.lowlevel.checkpoint()
            return
        self.waiting += 1
        self.held += 1
        try:
            await event.wait()
        finally:
            self.waiting -= 1

    def _matches(self, operation: str, session_id: str | None, after: bool) -> bool:
        return (
            self.operation == operation
            and self.after == after
            and (self.session_id is None or self.session_id == session_id)
        )


@attrs.frozen
class _Failure:
    times: int | None  # None: every call
    error: BaseException | None


@attrs.define(eq=False, repr=False)
class FaultyStore:
    """A store that stalls or fails chosen operations of the store it wraps.

    Everything else is forwarded unchanged, so it keeps the store contract
    (it passes ``check_store``). Use it to test what your code does when the
    store is slow or fails::

        store = FaultyStore(MemoryStore())
        store.fail("append", session_id="support-1")  # the next append of it fails
        gate = store.hold("write_snapshot")            # snapshots wait for gate.open()

    - ``hold(operation, session_id=None, after=False)`` returns a :class:`Gate`:
      calls of ``operation`` (of that session, or of any when ``None``) wait at it
      until ``gate.open()``; a gate never opened is a store that hangs. With
      ``after=True`` the call reaches the wrapped store first and its result is
      held (the write is done; its acknowledgement is late).
    - ``fail(operation, session_id=None, times=1, error=None, after=False)``:
      the next ``times`` calls (``None``: every call, until ``fail(...,
      times=0)``) raise ``error``, by default a ``StoreError``, instead of
      reaching the wrapped store. With ``after=True`` the call reaches the
      wrapped store first and then raises: the write is done, its
      acknowledgement is lost (a timeout after the server applied it). A
      failure for one session takes precedence over one for any; ``times=0``
      clears the plan it names only. A call waits at its gates before it fails.
    - ``calls`` counts the calls of each operation; ``injected`` counts the
      failures raised, of every operation together: a test asserts on it to
      prove its fault fired.

    The operations (``OPERATIONS``) are the methods of the Store protocol:
    ``create``, ``load``, ``append``, ``write_snapshot``, ``read_journal``,
    ``list_sessions``, ``exists``, ``delete``, ``claim``, ``renew``, ``release``
    and ``aclose``. A read of the journal a page at a time (``read_journal_page``,
    as a subscription's replay reads it) is a ``read_journal`` here: it meets that
    operation's gates and failures and counts as one. ``store`` defaults to a new
    ``MemoryStore``.
    """

    OPERATIONS: ClassVar[tuple[str, ...]] = _OPERATIONS

    store: Store = attrs.field(default=None, converter=_store_or_memory)
    calls: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    injected: int = attrs.field(default=0, init=False)
    _gates: list[Gate] = attrs.field(factory=list, init=False)
    _failures: dict[tuple[str, str | None, bool], _Failure] = attrs.field(factory=dict, init=False)

    def __repr__(self) -> str:
        return f"<FaultyStore over {self.store!r}>"

    def hold(self, operation: str, *, session_id: str | None = None, after: bool = False) -> Gate:
        """Hold the calls of ``operation`` at a new gate until ``gate.open()``."""
        _check_operation(operation)
        gate = Gate(operation, session_id=session_id, after=after)
        self._gates = [g for g in self._gates if not g.is_open]
        self._gates.append(gate)
        return gate

    def fail(
        self,
        operation: str,
        *,
        session_id: str | None = None,
        times: int | None = 1,
        error: BaseException | None = None,
        after: bool = False,
    ) -> None:
        """Make the next ``times`` calls of ``operation`` raise (replacing an earlier plan);
        with ``after``, once the wrapped store has done the call."""
        _check_operation(operation)
        if times is not None and times < 0:
            raise ValueError(f"times must be None (every call) or at least 0, not {times}")
        key = (operation, session_id, after)
        if times == 0:
            self._failures.pop(key, None)
        else:
            self._failures[key] = _Failure(times, error)

    def failures_left(
        self, operation: str, *, session_id: str | None = None, after: bool = False
    ) -> int | None:
        """How many failures planned by ``fail(operation, session_id=..., after=...)`` have
        not fired (``None``: every call fails)."""
        _check_operation(operation)
        failure = self._failures.get((operation, session_id, after))
        if failure is None:
            return 0
        return failure.times

    async def _enter(self, operation: str, session_id: str | None) -> None:
        self.calls[operation] += 1
        held = await self._wait(operation, session_id, after=False)
        await self._fail(operation, session_id, after=False, held=held)

    async def _leave(self, operation: str, session_id: str | None) -> None:
        """The wrapped store did the call: its answer waits at gates, or is lost."""
        held = await self._wait(operation, session_id, after=True)
        await self._fail(operation, session_id, after=True, held=held)

    async def _fail(
        self, operation: str, session_id: str | None, *, after: bool, held: bool
    ) -> None:
        key = (operation, session_id, after)
        if key not in self._failures:
            key = (operation, None, after)
        failure = self._failures.get(key)
        if failure is None:
            return
        if failure.times is not None:
            if failure.times <= 1:
                del self._failures[key]
            else:
                self._failures[key] = _Failure(failure.times - 1, failure.error)
        self.injected += 1
        if not held:  # every call checkpoints, like a real store's; a held one did
            await trio.lowlevel.checkpoint()
        if failure.error is not None:
            raise failure.error
        lost = " after the store did it" if after else ""
        raise StoreError(
            f"injected {operation} fault{lost} for session {session_id!r} (FaultyStore)",
            session_id=session_id,
        )

    async def _wait(self, operation: str, session_id: str | None, *, after: bool) -> bool:
        """Wait at every gate the call meets; whether there was one."""
        held = False
        for gate in list(self._gates):
            if not gate.is_open and gate._matches(operation, session_id, after):
                await gate.wait()
                held = True
        return held

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self._enter("create", session_id)
        await self.store.create(session_id, snapshot, info)
        await self._leave("create", session_id)

    async def load(self, session_id: str) -> StoredSession | None:
        await self._enter("load", session_id)
        result = await self.store.load(session_id)
        await self._leave("load", session_id)
        return result

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._enter("append", session_id)
        await self.store.append(session_id, entries, info, fence=fence)
        await self._leave("append", session_id)

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
        await self._enter("write_snapshot", session_id)
        await self.store.write_snapshot(
            session_id, snapshot, seq, info, trim_upto=trim_upto, fence=fence
        )
        await self._leave("write_snapshot", session_id)

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        await self._enter("read_journal", session_id)
        result = await self.store.read_journal(session_id, after)
        await self._leave("read_journal", session_id)
        return result

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        # a read of the journal: its gates, failures and count are read_journal's
        await self._enter("read_journal", session_id)
        result = await _read_page(self.store, session_id, after, limit, max_bytes)
        await self._leave("read_journal", session_id)
        return result

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await self._enter("list_sessions", None)
        result = await self.store.list_sessions()
        await self._leave("list_sessions", None)
        return result

    async def exists(self, session_id: str) -> bool:
        await self._enter("exists", session_id)
        result = await self.store.exists(session_id)
        await self._leave("exists", session_id)
        return result

    async def delete(self, session_id: str) -> bool:
        await self._enter("delete", session_id)
        result = await self.store.delete(session_id)
        await self._leave("delete", session_id)
        return result

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        await self._enter("claim", session_id)
        result = await self.store.claim(session_id, owner, ttl)
        await self._leave("claim", session_id)
        return result

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        await self._enter("renew", session_id)
        result = await self.store.renew(session_id, lease, ttl)
        await self._leave("renew", session_id)
        return result

    async def release(self, session_id: str, lease: Lease) -> None:
        await self._enter("release", session_id)
        await self.store.release(session_id, lease)
        await self._leave("release", session_id)

    async def aclose(self) -> None:
        await self._enter("aclose", None)
        await self.store.aclose()
        await self._leave("aclose", None)


# ---- FlawedStore -------------------------------------------------------------------

#: The ways a ``FlawedStore`` breaks the store contract.
_FLAWS: Final = (
    "lose_appends",
    "ack_appends_early",
    "lose_snapshots",
    "reorder_journal",
    "ignore_fences",
    "ignore_leases",
    "cut_values",
    "text_values",
)

#: Where ``FlawedStore("cut_values")`` cuts what it keeps (a column of a fixed size).
_CUT_AT: Final = 64 * 1024


def _check_flaw(instance: object, attribute: object, flaw: str) -> None:
    if flaw not in _FLAWS:
        raise ValueError(f"{flaw!r} is not a flaw FlawedStore has; use one of {', '.join(_FLAWS)}")


@attrs.define(eq=False, repr=False)
class FlawedStore:
    """A store broken on purpose, for negative controls: a durability test must fail with it.

    A test that checks "what was acknowledged survives" proves something only
    if it fails against a store that loses acknowledged writes. Run the same
    check with ``FlawedStore(flaw, store)`` and assert that it fails; a harness
    that passes with it catches nothing. Each flaw breaks one promise of the
    :class:`~sessionactors.stores.Store` contract (``FLAWS`` lists them) and
    otherwise forwards to ``store`` (default: a new ``MemoryStore``):

    - ``"lose_appends"``: ``append`` returns as if it had written, and writes nothing.
    - ``"ack_appends_early"``: ``append`` returns at once and is written only
      when this wrapper is next called: if the process dies first (the test
      drops the wrapper and opens a new one over the same ``store``), it is lost.
    - ``"lose_snapshots"``: ``write_snapshot`` trims the journal as asked but
      keeps the old snapshot (as a store that is not atomic does when it dies
      between the two): what the new snapshot held and the trimmed entries are lost.
    - ``"reorder_journal"``: ``load``, ``read_journal`` and ``read_journal_page``
      return the journal entries newest first.
    - ``"ignore_fences"``: writes drop their fencing token, so a stale owner's
      writes land.
    - ``"ignore_leases"``: ``claim`` hands out a lease even when another owner
      holds one, ``renew`` always succeeds, and writes drop their fencing token:
      two workers can run one session.
    - ``"cut_values"``: snapshots and journal entries are kept up to their first
      64 KiB, the rest dropped in silence (as a column of a fixed size may): a long
      conversation's next wake finds its data cut.
    - ``"text_values"``: snapshots and journal entries are kept as UTF-8 text, bytes
      that are not text replaced (as a text column keeps them): what is not ASCII
      comes back changed.
    """

    FLAWS: ClassVar[tuple[str, ...]] = _FLAWS

    flaw: str = attrs.field(validator=_check_flaw)
    store: Store = attrs.field(default=None, converter=_store_or_memory)
    _early: list[tuple[str, tuple[JournalEntry, ...], bytes, int | None]] = attrs.field(
        factory=list, init=False
    )

    def __repr__(self) -> str:
        return f"<FlawedStore {self.flaw} over {self.store!r}>"

    async def _catch_up(self) -> None:
        """Write the appends acknowledged early (``ack_appends_early``)."""
        while self._early:
            session_id, entries, info, fence = self._early.pop(0)
            await self.store.append(session_id, entries, info, fence=fence)

    def _fence(self, fence: int | None) -> int | None:
        return None if self.flaw in ("ignore_fences", "ignore_leases") else fence

    def _kept(self, data: bytes) -> bytes:
        """``data`` as this store keeps it."""
        if self.flaw == "cut_values":
            return data[:_CUT_AT]
        if self.flaw == "text_values":
            return data.decode("utf-8", "replace").encode()
        return data

    def _kept_entries(self, entries: Sequence[JournalEntry]) -> list[JournalEntry]:
        return [JournalEntry(entry.seq, self._kept(entry.data)) for entry in entries]

    def _reordered(self, entries: Sequence[JournalEntry]) -> list[JournalEntry]:
        if self.flaw == "reorder_journal":
            return list(reversed(entries))
        return list(entries)

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        await self._catch_up()
        await self.store.create(session_id, self._kept(snapshot), info)

    async def load(self, session_id: str) -> StoredSession | None:
        await self._catch_up()
        stored = await self.store.load(session_id)
        if stored is None or self.flaw != "reorder_journal":
            return stored
        return attrs.evolve(stored, entries=tuple(self._reordered(stored.entries)))

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._catch_up()
        if self.flaw == "lose_appends":
            await trio.lowlevel.checkpoint()
        elif self.flaw == "ack_appends_early":
            self._early.append((session_id, tuple(entries), bytes(info), fence))
            await trio.lowlevel.checkpoint()
        else:
            kept = self._kept_entries(entries)
            await self.store.append(session_id, kept, info, fence=self._fence(fence))

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
        await self._catch_up()
        if self.flaw == "lose_snapshots":
            old = await self.store.load(session_id)
            if old is not None:
                snapshot = old.snapshot
        await self.store.write_snapshot(
            session_id,
            self._kept(snapshot),
            seq,
            info,
            trim_upto=trim_upto,
            fence=self._fence(fence),
        )

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        await self._catch_up()
        trimmed, entries = await self.store.read_journal(session_id, after)
        return trimmed, self._reordered(entries)

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        await self._catch_up()
        trimmed, entries = await _read_page(self.store, session_id, after, limit, max_bytes)
        return trimmed, self._reordered(entries)

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        await self._catch_up()
        return await self.store.list_sessions()

    async def exists(self, session_id: str) -> bool:
        await self._catch_up()
        return await self.store.exists(session_id)

    async def delete(self, session_id: str) -> bool:
        await self._catch_up()
        return await self.store.delete(session_id)

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        await self._catch_up()
        lease = await self.store.claim(session_id, owner, ttl)
        if lease is None and self.flaw == "ignore_leases":
            return Lease(owner=owner, fence=0)  # a lease the store never issued
        return lease

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        await self._catch_up()
        renewed = await self.store.renew(session_id, lease, ttl)
        return renewed or self.flaw == "ignore_leases"

    async def release(self, session_id: str, lease: Lease) -> None:
        await self._catch_up()
        await self.store.release(session_id, lease)

    async def aclose(self) -> None:
        # Closing does not write what was acknowledged early: a process that dies
        # closes nothing either, and a clean exit has written everything before.
        await self.store.aclose()
