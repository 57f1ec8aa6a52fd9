"""``check_store``: the conformance suite every store must pass."""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import attrs
import trio

from .._codec import MAX_JOURNAL_ENTRY_BYTES, MAX_SEQ, MAX_SNAPSHOT_BYTES, dump_info
from .._errors import (
    FencedOutError,
    SessionActorsError,
    SessionExistsError,
    SessionNotFoundError,
    StoreError,
)
from .._listing import info_activity
from .._records import SessionInfo, Status
from ..stores._base import (
    IdlePageStore,
    JournalEntry,
    JournalPageStore,
    Lease,
    PagedStore,
    Store,
    StoredSession,
)

__all__ = ["check_store"]

_Check = Callable[[Store], Awaitable[None]]
_CHECKS: list[tuple[str, _Check]] = []
_Make = Callable[[], Store | Awaitable[Store]]
_Reopen = Callable[[Store], Store | Awaitable[Store]]

# Leases in the expiry check live this long; the check sleeps a little longer.
_SHORT_TTL = 0.3
_LONG_TTL = 60.0


async def check_store(make_store: _Make, *, reopen: _Reopen | None = None) -> None:
    """Check that the stores ``make_store`` makes keep the ``Store`` contract.

    Run it inside a trio test::

        async def test_my_store_conforms(tmp_path):
            with trio.fail_after(60):
                await check_store(
                    lambda: MyStore(tmp_path / f"{uuid.uuid4()}.db"),
                    reopen=lambda store: MyStore(store.path),
                )

    Every call of ``make_store()`` (sync, or async and awaited) must give a new,
    empty store independent of the others; each property is checked on its own
    store, which ``check_store`` closes when done with it. The first property
    that does not hold raises ``AssertionError`` naming it; an unexpected
    exception from the store (its ``aclose`` included) is reported the same way,
    with it as the cause.

    ``reopen(store)`` (sync, or async and awaited), if given, makes a second store
    over the data of ``store``, which is still open (the same file, database or
    key prefix), as the next process does after one that died without closing
    it: then what each write acknowledged is also read through that second store,
    which a store that acknowledges a write before it lasts (a write-behind
    buffer, a transaction left open) fails. Leave it out for a store whose data
    lives only in its object (``MemoryStore``).

    Leases expire on wall-clock time, so the suite runs on real time (it
    sleeps about half a second): do not run it under a mock or autojump clock.
    It takes a few seconds, plus the store's own latency (it writes a journal
    entry of ``MAX_JOURNAL_ENTRY_BYTES`` and a snapshot of ``MAX_SNAPSHOT_BYTES``,
    and holds a few copies of them in memory). It sets no timeouts: wrap it in
    ``trio.fail_after`` to bound a store that hangs.

    What it cannot check: that a write outlives the machine (a disk cache that
    loses it at power loss), and that a fencing token is checked in the same
    atomic step as the write it guards when another process takes the lease
    between the two (a race the suite does not provoke): see the custom-store
    how-to.

    A store written on an asyncio client is checked from an asyncio test with
    ``sessionactors.aio.check_store``, wrapped by ``sessionactors.aio.asyncio_store``.
    """
    checks = list(_CHECKS)
    if reopen is not None:  # (second: before properties a write-behind store may fail)
        checks.insert(1, (_REOPENED, functools.partial(_check_reopened, reopen=reopen)))
    for name, check in checks:
        store = await _made(make_store())
        failure: AssertionError | None = None
        try:
            await check(store)
        except AssertionError as exc:
            failure = AssertionError(f"store check failed: {name}: {exc}")
            failure.__cause__ = exc
        except Exception as exc:
            failure = AssertionError(
                f"store check failed: {name}: the store raised {type(exc).__name__}: {exc}"
            )
            failure.__cause__ = exc
        except BaseException:  # cancelled, interrupted: the store is closed all the same
            with contextlib.suppress(Exception):
                await _close(store)
            raise
        try:
            await _close(store)
        except Exception as exc:
            told = f"aclose raised {type(exc).__name__}: {exc}"
            if failure is None:
                failure = AssertionError(f"store check failed: {name}: {told}")
                failure.__cause__ = exc
            else:
                failure.add_note(f"(then {told})")
        if failure is not None:
            raise failure


async def _made(made: Store | Awaitable[Store]) -> Store:
    """The store a factory's call gave (awaited if it gave an awaitable)."""
    return await made if inspect.isawaitable(made) else made


async def _close(store: Store) -> None:
    """Close ``store``, twice (aclose is idempotent), shielded and bounded."""
    with trio.move_on_after(10, shield=True):
        await store.aclose()
        await store.aclose()


def _check(name: str) -> Callable[[_Check], _Check]:
    def register(check: _Check) -> _Check:
        _CHECKS.append((name, check))
        return check

    return register


def _expect(condition: bool, detail: str) -> None:
    if not condition:
        raise AssertionError(detail)


async def _expect_raises(
    error: type[SessionActorsError], call: Awaitable[object], what: str, session_id: str
) -> None:
    try:
        await call
    except error as exc:
        _expect(
            exc.session_id == session_id,
            f"{what} raised {type(exc).__name__} with session_id={exc.session_id!r}, "
            f"expected {session_id!r}",
        )
    except Exception as exc:
        raise AssertionError(
            f"{what} raised {type(exc).__name__} ({exc}), expected {error.__name__}"
        ) from exc
    else:
        raise AssertionError(f"{what} returned, expected it to raise {error.__name__}")


def _entries(*seqs: int, tag: bytes = b"e") -> list[JournalEntry]:
    return [JournalEntry(seq, tag + b"-%d" % seq) for seq in seqs]


async def _load(store: Store, session_id: str) -> StoredSession:
    stored = await store.load(session_id)
    _expect(stored is not None, f"load({session_id!r}) returned None for a stored session")
    assert stored is not None
    return stored


async def _expect_journal(
    store: Store, session_id: str, *, after: int, trimmed: int, expected: Sequence[JournalEntry]
) -> None:
    got = await store.read_journal(session_id, after)
    _expect(
        got == (trimmed, list(expected)),
        f"read_journal({session_id!r}, {after}) returned {got!r}, "
        f"expected {(trimmed, list(expected))!r}",
    )
    if isinstance(store, JournalPageStore):  # its pages: the same entries, bounded
        for limit, max_bytes, count in ((1000, 1 << 30, 1000), (2, 1 << 30, 2), (1000, 1, 1)):
            page = await store.read_journal_page(
                session_id, after, limit=limit, max_bytes=max_bytes
            )
            want = (trimmed, list(expected)[:count])
            _expect(
                page == want,
                f"read_journal_page({session_id!r}, {after}, limit={limit}, "
                f"max_bytes={max_bytes}) returned {page!r}, expected {want!r}",
            )


async def _expect_load(
    store: Store, session_id: str, *, snapshot: bytes, seq: int, entries: Sequence[JournalEntry]
) -> None:
    expected = StoredSession(snapshot=snapshot, snapshot_seq=seq, entries=tuple(entries))
    got = await _load(store, session_id)
    _expect(
        attrs.evolve(got, info=None) == expected,  # (the info: see _check_load_info)
        f"load({session_id!r}) returned {got!r}, expected {expected!r}",
    )
    _expect(
        type(got.snapshot) is bytes and all(type(e.data) is bytes for e in got.entries),
        f"load({session_id!r}) returned data that is not bytes",
    )


async def _claim(store: Store, session_id: str, owner: str, ttl: float = _LONG_TTL) -> Lease:
    lease = await store.claim(session_id, owner, ttl)
    _expect(lease is not None, f"claim({session_id!r}, {owner!r}) of a free lease returned None")
    assert lease is not None
    _expect(lease.owner == owner, f"claim by {owner!r} returned a lease for {lease.owner!r}")
    return lease


def _expect_larger(new: Lease, old: Lease, what: str) -> None:
    _expect(
        new.fence > old.fence,
        f"{what}: fencing token {new.fence} is not larger than the earlier {old.fence}",
    )


@_check("a new store is empty and implements the Store protocol")
async def _check_new_store(store: Store) -> None:
    _expect(isinstance(store, Store), f"{store!r} lacks methods of the Store protocol")
    listed = await store.list_sessions()
    _expect(listed == [], f"list_sessions() of a new store returned {listed!r}")


@_check("create then load returns the snapshot at seq 0")
async def _check_create_load(store: Store) -> None:
    await store.create("s", b"snapshot-0", b"info-0")
    await _expect_load(store, "s", snapshot=b"snapshot-0", seq=0, entries=[])
    _expect(await store.exists("s"), "exists('s') is False after create")
    await _expect_journal(store, "s", after=0, trimmed=0, expected=[])


@_check("create of a stored name raises SessionExistsError and changes nothing")
async def _check_create_twice(store: Store) -> None:
    await store.create("s", b"first", b"info")
    await _expect_raises(
        SessionExistsError, store.create("s", b"second", b"info"), "a second create('s')", "s"
    )
    await _expect_load(store, "s", snapshot=b"first", seq=0, entries=[])


@_check("load of an unknown session returns None")
async def _check_load_unknown(store: Store) -> None:
    got = await store.load("missing")
    _expect(got is None, f"load('missing') returned {got!r}")
    _expect(not await store.exists("missing"), "exists('missing') is True")


@_check("appended entries load in order")
async def _check_append(store: Store) -> None:
    await store.create("s", b"snap", b"info")
    await store.append("s", _entries(1, 2), b"info")
    await store.append("s", _entries(3), b"info")
    await store.append("s", _entries(7, 10), b"info")
    everything = _entries(1, 2, 3, 7, 10)
    await _expect_load(store, "s", snapshot=b"snap", seq=0, entries=everything)
    await _expect_journal(store, "s", after=0, trimmed=0, expected=everything)
    await _expect_journal(store, "s", after=3, trimmed=0, expected=_entries(7, 10))
    await _expect_journal(store, "s", after=10, trimmed=0, expected=[])


@_check("load returns the snapshot and only the journal entries after it")
async def _check_journal_tail(store: Store) -> None:
    await store.create("s", b"snap-0", b"info")
    await store.append("s", _entries(1, 2, 3, 4, 5), b"info")
    await store.write_snapshot("s", b"snap-3", 3, b"info", trim_upto=0)
    await _expect_load(store, "s", snapshot=b"snap-3", seq=3, entries=_entries(4, 5))
    await _expect_journal(store, "s", after=0, trimmed=0, expected=_entries(1, 2, 3, 4, 5))


@_check("load gives the info of the last write with the snapshot and journal, or none")
async def _check_load_info(store: Store) -> None:
    async def expect_info(info: bytes, after: str) -> None:
        got = (await _load(store, "s")).info
        _expect(
            got is None or got == info,
            f"load('s') gave the info {got!r} after {after}, expected {info!r} (or None: "
            "a store that does not give it)",
        )

    await store.create("s", b"snap-0", b"info-0")
    await expect_info(b"info-0", "create")
    await store.append("s", _entries(1, 2), b"info-2")
    await expect_info(b"info-2", "append")
    await store.write_snapshot("s", b"snap-2", 2, b"info-snap", trim_upto=0)
    await expect_info(b"info-snap", "write_snapshot")


@_check("write_snapshot with trim_upto drops the entries up to it")
async def _check_compaction(store: Store) -> None:
    await store.create("s", b"snap-0", b"info")
    await store.append("s", _entries(1, 2, 3, 4, 5, 6), b"info")
    await store.write_snapshot("s", b"snap-4", 4, b"info", trim_upto=2)
    await _expect_journal(store, "s", after=0, trimmed=2, expected=_entries(3, 4, 5, 6))
    await _expect_journal(store, "s", after=4, trimmed=2, expected=_entries(5, 6))
    await _expect_load(store, "s", snapshot=b"snap-4", seq=4, entries=_entries(5, 6))
    await store.write_snapshot("s", b"snap-6", 6, b"info", trim_upto=6)
    await _expect_journal(store, "s", after=0, trimmed=6, expected=[])
    await _expect_load(store, "s", snapshot=b"snap-6", seq=6, entries=[])
    await store.append("s", _entries(7), b"info")
    await _expect_journal(store, "s", after=0, trimmed=6, expected=_entries(7))
    await _expect_load(store, "s", snapshot=b"snap-6", seq=6, entries=_entries(7))


@_check("reads and writes of an unknown session raise SessionNotFoundError")
async def _check_unknown(store: Store) -> None:
    await _expect_raises(
        SessionNotFoundError, store.read_journal("missing", 0), "read_journal('missing')", "missing"
    )
    await _expect_raises(
        SessionNotFoundError,
        store.append("missing", _entries(1), b"info"),
        "append('missing')",
        "missing",
    )
    await _expect_raises(
        SessionNotFoundError,
        store.write_snapshot("missing", b"snap", 1, b"info", trim_upto=0),
        "write_snapshot('missing')",
        "missing",
    )
    _expect(not await store.exists("missing"), "a failed write to 'missing' stored it")


@_check("a journal seq not above every stored one raises StoreError and writes nothing")
async def _check_seqs(store: Store) -> None:
    await store.create("s", b"snap", b"info")
    await store.append("s", _entries(1, 2), b"info")
    for bad, what in [
        (_entries(2), "a repeated seq"),
        (_entries(1), "a lower seq"),
        (_entries(3, 3), "a batch repeating a seq"),
        (_entries(4, 3), "a batch out of order"),
    ]:
        await _expect_raises(StoreError, store.append("s", bad, b"info"), f"append of {what}", "s")
    await _expect_journal(store, "s", after=0, trimmed=0, expected=_entries(1, 2))
    await store.append("s", _entries(3), b"info")
    await store.write_snapshot("s", b"snap-3", 3, b"info", trim_upto=3)
    await _expect_raises(
        StoreError, store.append("s", _entries(3), b"info"), "append of a trimmed seq", "s"
    )
    await store.append("s", _entries(4), b"info")
    await _expect_journal(store, "s", after=0, trimmed=3, expected=_entries(4))


@_check("list_sessions returns every session with its latest info")
async def _check_list(store: Store) -> None:
    await store.create("a", b"snap", b"a-0")
    await store.create("b", b"snap", b"b-0")
    await store.create("c", b"snap", b"c-0")
    await store.append("b", _entries(1), b"b-1")
    await store.write_snapshot("c", b"snap-1", 1, b"c-1", trim_upto=0)
    listed = sorted(await store.list_sessions())
    expected = [("a", b"a-0"), ("b", b"b-1"), ("c", b"c-1")]
    _expect(listed == expected, f"list_sessions() returned {listed!r}, expected {expected!r}")


def _info_at(name: str, minute: int) -> bytes:
    at = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(minutes=minute)
    info = SessionInfo(
        session_id=name, agent=None, status=Status.IDLE, message_count=0, updated_at=at
    )
    return dump_info(info)


@_check("list_page pages newest activity first (then by name, descending), after a name")
async def _check_list_page(store: Store) -> None:
    if not isinstance(store, PagedStore):
        return  # a store without list_page is listed whole, through list_sessions
    minutes = {"a": 3, "b": 1, "c": 3, "d": 2, "e": 0, "f \u00fc": 3, "g": 1}
    for name, minute in minutes.items():
        await store.create(name, b"snap", _info_at(name, minute))
    await store.append("e", _entries(1), _info_at("e", 5))  # moves to the front
    await store.write_snapshot("b", b"snap-1", 1, _info_at("b", 4), trim_upto=0)
    await store.delete("d")
    await store.append("g", _entries(1), b"unreadable")  # counts as the oldest
    infos = {name: _info_at(name, minute) for name, minute in minutes.items()}
    infos.update(e=_info_at("e", 5), b=_info_at("b", 4), g=b"unreadable")
    order = ["e", "b", "f \u00fc", "c", "a", "g"]
    expected = [(name, infos[name]) for name in order]
    whole = await store.list_page(after=None, limit=100)
    _expect(whole == expected, f"list_page(limit=100) returned {whole!r}, expected {expected!r}")
    pages: list[tuple[str, bytes]] = []
    after: str | None = None
    for _ in range(10):
        page = await store.list_page(after=after, limit=2)
        _expect(len(page) <= 2, f"list_page(limit=2) returned {len(page)} sessions")
        if not page:
            break
        pages += page
        after = page[-1][0]
    _expect(pages == expected, f"pages of 2 joined are {pages!r}, expected {expected!r}")
    tail = await store.list_page(after="c", limit=100)
    _expect(tail == expected[4:], f"list_page(after='c') returned {tail!r}")
    await _expect_raises(
        SessionNotFoundError,
        store.list_page(after="d", limit=10),
        "list_page after a deleted session",
        "d",
    )


@_check("list_idle_page pages the sessions active before a time, in listing order, after a name")
async def _check_list_idle_page(store: Store) -> None:
    if not isinstance(store, IdlePageStore):
        return  # a store without it is listed through list_page, filtered as it is read
    minutes = {"a": 3, "b": 1, "c": 3, "d": 2, "e": 0, "f \u00fc": 3, "g": 1}
    for name, minute in minutes.items():
        await store.create(name, b"snap", _info_at(name, minute))
    await store.append("e", _entries(1), _info_at("e", 5))  # moves to the front
    await store.write_snapshot("b", b"snap-1", 1, _info_at("b", 4), trim_upto=0)
    await store.delete("d")
    await store.append("g", _entries(1), b"unreadable")  # counts as the oldest (0)
    infos = {name: _info_at(name, minute) for name, minute in minutes.items()}
    infos.update(g=b"unreadable")
    at_3 = info_activity(_info_at("x", 3))
    cases = [
        (at_3 + 1, None, ["f \u00fc", "c", "a", "g"]),
        (at_3, None, ["g"]),
        (1, None, ["g"]),
        (0, None, []),
        (at_3 + 1, "c", ["a", "g"]),
        (at_3 + 1, "e", ["f \u00fc", "c", "a", "g"]),  # after one active since: from the start
        (at_3, "c", ["g"]),
        (info_activity(_info_at("x", 6)), "b", ["f \u00fc", "c", "a", "g"]),
    ]
    for before, start, names in cases:
        page = await store.list_idle_page(active_before=before, after=start, limit=100)
        expected = [(name, infos[name]) for name in names]
        _expect(
            page == expected,
            f"list_idle_page(active_before={before}, after={start!r}) returned {page!r}, "
            f"expected {expected!r}",
        )
    pages: list[tuple[str, bytes]] = []
    after: str | None = None
    for _ in range(10):
        page = await store.list_idle_page(active_before=at_3 + 1, after=after, limit=2)
        _expect(len(page) <= 2, f"list_idle_page(limit=2) returned {len(page)} sessions")
        if not page:
            break
        pages += page
        after = page[-1][0]
    expected = [(name, infos[name]) for name in ["f \u00fc", "c", "a", "g"]]
    _expect(pages == expected, f"pages of 2 joined are {pages!r}, expected {expected!r}")
    await _expect_raises(
        SessionNotFoundError,
        store.list_idle_page(active_before=at_3, after="d", limit=10),
        "list_idle_page after a deleted session",
        "d",
    )


@_check("delete removes the snapshot, journal and lease, and the name can be created afresh")
async def _check_delete(store: Store) -> None:
    await store.create("a", b"snap-a", b"info")
    await store.create("b", b"snap-b", b"info")
    await store.append("a", _entries(1, 2), b"info")
    before = await _claim(store, "a", "worker-1")
    _expect(await store.delete("a"), "delete('a') of a stored session returned False")
    _expect(not await store.exists("a"), "exists('a') is True after delete")
    got = await store.load("a")
    _expect(got is None, f"load('a') returned {got!r} after delete")
    listed = await store.list_sessions()
    _expect(listed == [("b", b"info")], f"list_sessions() returned {listed!r} after delete")
    await _expect_raises(
        SessionNotFoundError, store.read_journal("a", 0), "read_journal after delete", "a"
    )
    _expect(not await store.delete("a"), "a second delete('a') returned True")
    _expect(not await store.delete("missing"), "delete('missing') returned True")
    # The lease went with the session, but fencing tokens keep growing.
    after = await _claim(store, "a", "worker-2")
    _expect_larger(after, before, "a claim after delete")
    await store.create("a", b"snap-a2", b"info")
    await _expect_load(store, "a", snapshot=b"snap-a2", seq=0, entries=[])
    await _expect_journal(store, "a", after=0, trimmed=0, expected=[])
    await store.append("a", _entries(1), b"info", fence=after.fence)
    await _expect_raises(
        FencedOutError,
        store.append("a", _entries(2), b"info", fence=before.fence),
        "append with a token from before the delete",
        "a",
    )
    await _expect_load(store, "a", snapshot=b"snap-a2", seq=0, entries=_entries(1))


_NAMES = [
    "../../etc/passwd",
    "/absolute/path",
    "C:\\Windows\\system32",
    "..",
    ".",
    "a/b?c#d%20e&f=g",
    "'; DROP TABLE sessions; --",
    'robert"); DELETE FROM journal; --',
    "%",
    "_",
    "*",
    "Session",
    "session",
    "caf\u00e9",  # composed
    "cafe\u0301",  # decomposed: a different name
    "\u4f1a\u8bdd-\U0001f642",
    " leading and trailing space ",
    "\u00e9" * 128,  # 256 UTF-8 bytes
    "x" * 256,
]


@_check("names that look like paths, SQL or unicode tricks are stored and returned exactly")
async def _check_names(store: Store) -> None:
    for name in _NAMES:
        await store.create(name, name.encode() + b"!", name.encode())
        await store.append(name, [JournalEntry(1, name.encode())], name.encode() + b"?")
    listed = sorted(await store.list_sessions())
    expected = sorted((name, name.encode() + b"?") for name in _NAMES)
    _expect(listed == expected, f"list_sessions() returned {listed!r}, expected {expected!r}")
    for name in _NAMES:
        _expect(await store.exists(name), f"exists({name!r}) is False")
        await _expect_load(
            store,
            name,
            snapshot=name.encode() + b"!",
            seq=0,
            entries=[JournalEntry(1, name.encode())],
        )
    for name in _NAMES[::2]:
        _expect(await store.delete(name), f"delete({name!r}) returned False")
    kept = sorted(session_id for session_id, _ in await store.list_sessions())
    _expect(kept == sorted(_NAMES[1::2]), f"list_sessions() after deletes named {kept!r}")


@_check("concurrent claims of one session have exactly one winner")
async def _check_concurrent_claims(store: Store) -> None:
    results: dict[str, Lease | None] = {}

    async def claim(owner: str) -> None:
        results[owner] = await store.claim("s", owner, _LONG_TTL)

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(claim, f"worker-{i}")
    winners = {owner: lease for owner, lease in results.items() if lease is not None}
    _expect(len(winners) == 1, f"{len(winners)} of 50 concurrent claims won: {winners!r}")
    ((owner, lease),) = winners.items()
    _expect(lease.owner == owner, f"the winner {owner!r} got a lease for {lease.owner!r}")


@_check("claims, renewals and releases follow the lease and its fencing token")
async def _check_claims(store: Store) -> None:
    await store.create("s", b"snap", b"info")
    first = await _claim(store, "s", "worker-1")
    issued = [first]
    other = await store.claim("s", "worker-2", _LONG_TTL)
    _expect(other is None, f"claim by worker-2 of a held lease returned {other!r}")
    again = await _claim(store, "s", "worker-1")
    _expect_larger(again, first, "a re-claim by the same owner")
    issued.append(again)
    _expect(
        not await store.renew("s", first, _LONG_TTL),
        "renew with a token replaced by a re-claim returned True",
    )
    _expect(await store.renew("s", again, _LONG_TTL), "renew by the holder returned False")
    _expect(
        not await store.renew("s", Lease(owner="worker-2", fence=again.fence), _LONG_TTL),
        "renew by an owner that does not hold the lease returned True",
    )
    await store.release("s", first)  # stale: nothing happens
    other = await store.claim("s", "worker-2", _LONG_TTL)
    _expect(other is None, "release with a stale lease freed the lease")
    await store.release("s", again)
    _expect(not await store.renew("s", again, _LONG_TTL), "renew of a released lease returned True")
    second = await _claim(store, "s", "worker-2")
    issued.append(second)
    await store.release("s", second)
    issued.append(await _claim(store, "s", "worker-1"))
    fences = [lease.fence for lease in issued]
    _expect(
        all(a < b for a, b in itertools.pairwise(fences)),
        f"fencing tokens did not strictly increase: {fences}",
    )
    unstored = await _claim(store, "never-created", "worker-1")
    _expect(not await store.exists("never-created"), "a claim created the session")
    await store.release("never-created", unstored)


@_check("writes with a stale fencing token raise FencedOutError and write nothing")
async def _check_fencing(store: Store) -> None:
    await store.create("s", b"snap-0", b"info")
    old = await _claim(store, "s", "worker-1")
    await store.append("s", _entries(1, 2), b"info", fence=old.fence)
    await store.write_snapshot("s", b"snap-1", 1, b"info", trim_upto=0, fence=old.fence)
    await store.release("s", old)
    await _expect_raises(
        FencedOutError,
        store.append("s", _entries(3), b"info", fence=old.fence),
        "append with the token of a released lease",
        "s",
    )
    new = await _claim(store, "s", "worker-2")
    await _expect_raises(
        FencedOutError,
        store.append("s", _entries(3), b"info", fence=old.fence),
        "append with a stale token",
        "s",
    )
    await _expect_raises(
        FencedOutError,
        store.write_snapshot("s", b"snap-stale", 2, b"info", trim_upto=2, fence=old.fence),
        "write_snapshot with a stale token",
        "s",
    )
    await _expect_raises(
        FencedOutError,
        store.append("s", _entries(3), b"info", fence=new.fence + 1000),
        "append with a token never issued",
        "s",
    )
    await _expect_load(store, "s", snapshot=b"snap-1", seq=1, entries=_entries(2))
    await _expect_journal(store, "s", after=0, trimmed=0, expected=_entries(1, 2))
    await store.append("s", _entries(3), b"info", fence=new.fence)
    # Writes without a token are never fenced, even while another owner holds the lease.
    await store.append("s", _entries(4), b"info")
    await store.write_snapshot("s", b"snap-4", 4, b"info", trim_upto=1)
    await _expect_load(store, "s", snapshot=b"snap-4", seq=4, entries=[])
    await _expect_journal(store, "s", after=0, trimmed=1, expected=_entries(2, 3, 4))
    await store.create("unleased", b"snap", b"info")
    await _expect_raises(
        FencedOutError,
        store.append("unleased", _entries(1), b"info", fence=1),
        "append with a token for a session never claimed",
        "unleased",
    )
    await store.append("unleased", _entries(1), b"info")


@_check("an expired lease can be taken over, and its token no longer writes")
async def _check_expiry(store: Store) -> None:
    await store.create("expiring", b"snap", b"info")
    await store.create("renewed", b"snap", b"info")
    expiring = await _claim(store, "expiring", "worker-1", _SHORT_TTL)
    renewed = await _claim(store, "renewed", "worker-1", _SHORT_TTL)
    _expect(await store.renew("renewed", renewed, _LONG_TTL), "renew by the holder returned False")
    other = await store.claim("expiring", "worker-2", _LONG_TTL)
    _expect(other is None, "a lease was taken over before it expired")
    await trio.sleep(_SHORT_TTL * 1.5)
    await _expect_raises(
        FencedOutError,
        store.append("expiring", _entries(1), b"info", fence=expiring.fence),
        "append with the token of an expired lease",
        "expiring",
    )
    _expect(
        not await store.renew("expiring", expiring, _LONG_TTL),
        "renew of an expired lease returned True",
    )
    other = await store.claim("renewed", "worker-2", _LONG_TTL)
    _expect(other is None, "a renewed lease was taken over at its first expiry")
    takeover = await _claim(store, "expiring", "worker-2")
    _expect_larger(takeover, expiring, "a takeover of an expired lease")
    await _expect_raises(
        FencedOutError,
        store.append("expiring", _entries(1), b"info", fence=expiring.fence),
        "append with the token of a lease taken over",
        "expiring",
    )
    await store.append("expiring", _entries(1), b"info", fence=takeover.fence)
    await _expect_load(store, "expiring", snapshot=b"snap", seq=0, entries=_entries(1))


@_check("seqs up to MAX_SEQ are stored; a seq above it raises StoreError and writes nothing")
async def _check_seq_range(store: Store) -> None:
    await store.create("s", b"snap", b"info")
    for bad in (MAX_SEQ + 1, 2**63, 2**64):
        await _expect_raises(
            StoreError, store.append("s", _entries(bad), b"info"), f"append of seq {bad}", "s"
        )
        await _expect_raises(
            StoreError,
            store.write_snapshot("s", b"snap-bad", bad, b"info", trim_upto=0),
            f"write_snapshot at seq {bad}",
            "s",
        )
    await _expect_load(store, "s", snapshot=b"snap", seq=0, entries=[])
    await store.append("s", _entries(1, MAX_SEQ), b"info")
    await _expect_load(store, "s", snapshot=b"snap", seq=0, entries=_entries(1, MAX_SEQ))
    await _expect_journal(store, "s", after=1, trimmed=0, expected=_entries(MAX_SEQ))
    await store.write_snapshot("s", b"snap-max", MAX_SEQ, b"info", trim_upto=MAX_SEQ)
    await _expect_load(store, "s", snapshot=b"snap-max", seq=MAX_SEQ, entries=[])
    await _expect_journal(store, "s", after=0, trimmed=MAX_SEQ, expected=[])


@_check("appends made together each succeed or fail alone, under their own session's name")
async def _check_appends_fail_alone(store: Store) -> None:
    names = [f"s{i}" for i in range(24)]
    for name in names:
        await store.create(name, b"snap", b"info")
    await store.append("s7", _entries(1, 2), b"info")
    failed: dict[str, BaseException] = {}

    async def append(name: str, seq: int) -> None:
        try:
            await store.append(name, _entries(seq), b"info-2")
        except Exception as exc:
            failed[name] = exc

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(append, name, 2 if name == "s7" else 1)  # s7's is stale
        nursery.start_soon(append, "missing", 1)
    stale, missing = failed.pop("s7", None), failed.pop("missing", None)
    _expect(
        not failed,
        "appends next to a failing one failed: "
        + ", ".join(f"{name}: {type(exc).__name__} ({exc})" for name, exc in failed.items()),
    )
    _expect(
        isinstance(stale, StoreError) and stale.session_id == "s7",
        f"the stale append to 's7' raised {stale!r}, expected StoreError for 's7'",
    )
    _expect(
        isinstance(missing, SessionNotFoundError) and missing.session_id == "missing",
        f"the append to 'missing' raised {missing!r}, expected SessionNotFoundError",
    )
    for name in names:
        expected = _entries(1, 2) if name == "s7" else _entries(1)
        await _expect_journal(store, name, after=0, trimmed=0, expected=expected)
    listed = dict(await store.list_sessions())
    _expect(listed["s1"] == b"info-2", f"the info of 's1' is {listed['s1']!r}, expected b'info-2'")
    _expect(
        listed["s7"] == b"info", f"a refused append replaced the info of 's7': {listed['s7']!r}"
    )


@_check("a store used after aclose holds what it held, or raises StoreError: never reads empty")
async def _check_reuse_after_aclose(store: Store) -> None:
    await store.create("s", b"snap", b"info")
    await store.append("s", _entries(1), b"info-1")
    await store.aclose()
    try:
        listed = await store.list_sessions()
    except StoreError:
        return  # a closed store may refuse; it must not look empty
    _expect(listed == [("s", b"info-1")], f"list_sessions() after aclose returned {listed!r}")
    await _expect_load(store, "s", snapshot=b"snap", seq=0, entries=_entries(1))


#: bytes no UTF-8 text holds (NUL, a byte never in UTF-8, a cut sequence, a surrogate's
#: encoding), then every byte value
_ODD: Final = b"\x00\xff\xfe\xc3(\xed\xa0\x80" + bytes(range(256))


def _filler(size: int, shift: int) -> bytes:
    """``size`` bytes of every value in turn, from ``shift`` on (no two sizes alike)."""
    run = bytes(range(shift, 256)) + bytes(range(shift))
    return (run * (size // 256 + 1))[:size]


def _expect_same(got: bytes, want: bytes, what: str) -> None:
    """``got`` is ``want``, told by sizes and the first byte that differs (not reprs of
    megabytes)."""
    if got == want:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    where = f"they differ from byte {at:,} on" if at is not None else "one begins the other"
    raise AssertionError(f"{what}: {len(got):,} bytes came back for {len(want):,} ({where})")


@_check(
    "snapshots and journal entries come back byte for byte: any byte, and as large as a "
    "session writes (MAX_JOURNAL_ENTRY_BYTES, MAX_SNAPSHOT_BYTES)"
)
async def _check_values_whole(store: Store) -> None:
    big_entry = _filler(MAX_JOURNAL_ENTRY_BYTES, 1)
    await store.create("s", _ODD, _ODD)
    listed = await store.list_sessions()
    _expect(len(listed) == 1, f"list_sessions() returned {len(listed)} sessions of 1")
    _expect_same(listed[0][1], _ODD, "an info of odd bytes, as list_sessions read it")
    await store.append("s", [JournalEntry(1, _ODD), JournalEntry(2, big_entry)], b"info")
    stored = await _load(store, "s")
    _expect_same(stored.snapshot, _ODD, "the snapshot that create wrote, as load read it")
    _expect(len(stored.entries) == 2, f"load read {len(stored.entries)} entries of 2")
    _expect_same(stored.entries[0].data, _ODD, "an entry of odd bytes, as load read it")
    _expect_same(stored.entries[1].data, big_entry, "the largest entry, as load read it")
    del stored
    _, entries = await store.read_journal("s", 1)
    _expect(len(entries) == 1, f"read_journal('s', 1) read {len(entries)} entries of 1")
    _expect_same(entries[0].data, big_entry, "the largest entry, as read_journal read it")
    del entries
    big_snapshot = _filler(MAX_SNAPSHOT_BYTES, 2)
    await store.write_snapshot("s", big_snapshot, 2, b"info", trim_upto=0)
    stored = await _load(store, "s")
    _expect_same(stored.snapshot, big_snapshot, "the largest snapshot, as load read it")


_REOPENED: Final = (
    "what each write acknowledged is read through another store over the same data "
    "(reopen), while the first is open"
)


async def _check_reopened(store: Store, *, reopen: _Reopen) -> None:
    async def another(check: Callable[[Store], Awaitable[None]]) -> None:
        """Run ``check`` on a second store over the data (made just after the first
        store's last write), and close it."""
        second = await _made(reopen(store))
        try:
            await check(second)
        finally:
            await _close(second)

    def holds(snapshot: bytes, seq: int, *seqs: int) -> Callable[[Store], Awaitable[None]]:
        async def check(second: Store) -> None:
            stored = await second.load("s")
            want = StoredSession(
                snapshot=snapshot, snapshot_seq=seq, entries=tuple(_entries(*seqs))
            )
            _expect(
                stored is not None and attrs.evolve(stored, info=None) == want,
                f"load('s') through another store returned {stored!r}, expected {want!r}",
            )

        return check

    async def listed(second: Store) -> None:
        got = await second.list_sessions()
        _expect(got == [("s", _ODD)], f"list_sessions() through another store returned {got!r}")

    async def journal(second: Store) -> None:
        got = await second.read_journal("s", 0)
        _expect(got == (1, _entries(2)), f"read_journal('s', 0) through another store: {got!r}")

    async def gone(second: Store) -> None:
        _expect(await second.load("s") is None, "a deleted session loads through another store")

    await store.create("s", b"snap-0", _ODD)  # (an info of any bytes)
    await another(holds(b"snap-0", 0))
    await another(listed)
    await store.append("s", _entries(1, 2), b"info-2")
    await another(holds(b"snap-0", 0, 1, 2))
    await store.write_snapshot("s", b"snap-2", 2, b"info-3", trim_upto=1)
    await another(holds(b"snap-2", 2))
    await another(journal)
    await store.delete("s")
    await another(gone)
