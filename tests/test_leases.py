"""Leases on a shared SQLite file: one live owner per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from sessionactors.stores import Lease, Store
from sessionactors.testing import EchoModel, FaultyStore, FlawedStore

AGENTS = {"echo": sa.Agent(model=EchoModel())}


async def test_a_session_live_on_one_worker_is_busy_for_another(tmp_path: Path) -> None:
    """While worker A holds the lease, worker B's request raises SessionBusyError; after A hibernates it, B wakes it."""
    path = tmp_path / "shared.db"
    with trio.fail_after(30):
        async with (
            sa.open_registry(store=sa.SQLiteStore(path), agents=AGENTS, leases=True) as a,
            sa.open_registry(store=sa.SQLiteStore(path), agents=AGENTS, leases=True) as b,
        ):
            ref_a = await a.spawn("shared")
            await ref_a.send("hello from A")
            # (both in this process: the error does not say "another process")
            with pytest.raises(sa.SessionBusyError, match=r"another registry, in this process or"):
                await b.ref("shared").send("hello from B")
            await ref_a.hibernate()
            reply = await b.ref("shared").send("hello from B")
            assert reply.text == "hello from B"
            assert [m.content for m in await b.ref("shared").history()][::2] == [
                "hello from A",
                "hello from B",
            ]
            assert a.live() == []
            assert b.live() == ["shared"]


async def test_a_worker_restarted_with_its_id_takes_its_sessions_back(tmp_path: Path) -> None:
    """A worker that died holding a lease gets it back at once when restarted with the same worker_id."""
    path = tmp_path / "shared.db"
    with trio.fail_after(30):
        async with sa.open_registry(
            store=sa.SQLiteStore(path), agents=AGENTS, leases=True, worker_id="web-1"
        ) as first:
            await (await first.spawn("s")).send("one")
        store = sa.SQLiteStore(path)
        assert await store.claim("s", "web-1", 60.0) is not None  # web-1 dies holding it
        await store.aclose()
        async with sa.open_registry(
            store=sa.SQLiteStore(path), agents=AGENTS, leases=True, worker_id="web-2"
        ) as other:
            with pytest.raises(sa.SessionBusyError):
                await other.ref("s").send("web-2 must wait for the lease")
        async with sa.open_registry(
            store=sa.SQLiteStore(path), agents=AGENTS, leases=True, worker_id="web-1"
        ) as again:
            assert (await again.ref("s").send("back")).text == "back"


class PausedRenewals(sa.SQLiteStore):
    """A worker whose renewals never reach the store (as if its process were paused)."""

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        await trio.lowlevel.checkpoint()
        return True


async def stale_owner_writes(path: Path, store_a: Store) -> tuple[BaseException | None, list[str]]:
    """A owns "s", its lease lapses, B takes over; A sends once more. Returns A's error and the stored texts."""
    error: BaseException | None = None
    async with sa.open_registry(store=store_a, agents=AGENTS, leases=True, lease_ttl=0.3) as a:
        ref_a = await a.spawn("s")
        await ref_a.send("one")
        await trio.sleep(0.5)  # A's lease expires: its renewals never landed
        async with sa.open_registry(
            store=sa.SQLiteStore(path), agents=AGENTS, leases=True, lease_ttl=30
        ) as b:
            assert (await b.ref("s").send("two")).text == "two"
            try:
                await ref_a.send("stale write from A")
            except sa.SessionActorsError as exc:
                error = exc
            texts = [m.content for m in await b.ref("s").history()]
            await b.ref("s").hibernate()
    return error, texts


async def test_a_stale_worker_is_fenced_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """When another worker takes an expired lease over, the old owner's write is refused and not stored; the error and the log say that a later claim holds the lease (not that the store lost data), and the error says to send the request again."""
    path = tmp_path / "shared.db"
    with trio.fail_after(30):
        error, texts = await stale_owner_writes(path, PausedRenewals(path))
    assert isinstance(error, sa.FencedOutError)
    assert not error.lost_data
    assert "another worker took the session over" in str(error)
    assert "send the request again" in str(error)
    [logged] = [r for r in caplog.records if "no longer shows" in r.getMessage()]
    assert logged.levelname == "WARNING"
    assert "another worker took it over, or the store lost or rolled back" in logged.getMessage()
    assert "stale write from A" not in texts
    assert texts[::2] == ["one", "two"]


async def test_without_fencing_no_fenced_out_error_is_raised(tmp_path: Path) -> None:
    """The same scenario with a store that drops the token (the test kit's FlawedStore) raises no FencedOutError (negative control)."""
    path = tmp_path / "shared.db"
    with trio.fail_after(30):
        error, texts = await stale_owner_writes(
            path, FlawedStore("ignore_fences", PausedRenewals(path))
        )
    # the store's seq check still refuses it (the new owner's seqs jumped), but not
    # through fencing: FencedOutError comes from the token alone
    assert not isinstance(error, sa.FencedOutError)
    assert "stale write from A" not in texts


async def test_a_request_for_an_unknown_name_is_answered_after_its_lease_is_free(
    tmp_path: Path,
) -> None:
    """The caller of a request that found no such session hears of it only once the
    lease its wake took is given back: a spawn elsewhere right after never finds it held."""
    path = tmp_path / "shared.db"
    store = FaultyStore(sa.SQLiteStore(path))
    gate = store.hold("release", session_id="later")
    errors: list[Exception] = []

    async def ask(registry: sa.Registry) -> None:
        with pytest.raises(sa.SessionNotFoundError) as caught:
            await registry.ref("later").send("is anyone there?")
        errors.append(caught.value)

    with trio.fail_after(30):
        async with sa.open_registry(store=store, agents=AGENTS, leases=True) as a:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, a)
                while not gate.waiting:
                    await trio.sleep(0.01)  # the release runs in SQLite's thread
                await trio.testing.wait_all_tasks_blocked()
                assert errors == []  # the lease is still held: no answer yet
                gate.open()
            assert len(errors) == 1


async def test_a_request_for_an_unknown_name_holds_no_lease(tmp_path: Path) -> None:
    """A request that finds no such session leaves its lease free, so another worker can spawn the name at once."""
    path = tmp_path / "shared.db"
    with trio.fail_after(30):
        async with (
            sa.open_registry(store=sa.SQLiteStore(path), agents=AGENTS, leases=True) as a,
            sa.open_registry(store=sa.SQLiteStore(path), agents=AGENTS, leases=True) as b,
        ):
            with pytest.raises(sa.SessionNotFoundError):
                await a.ref("later").send("is anyone there?")
            ref = await b.spawn("later")
            assert (await ref.send("here")).text == "here"
