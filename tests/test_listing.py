"""Listing sessions: newest activity first, filtered, in pages, from every store; a
registry without agents reads and manages a store; ref.set_metadata merges metadata."""

from __future__ import annotations

import datetime
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import msgpack
import pytest
import trio

import sessionactors as sa
from forwarding_store import Forwarding
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel, FaultyStore, Scripted, ScriptedModel

StoreFactory = Callable[[], sa.MemoryStore | sa.SQLiteStore | RedisStore]


@pytest.fixture(params=["memory", "sqlite", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """A factory of one store (the same store on every call): memory, SQLite or Redis."""
    if request.param == "memory":
        store = sa.MemoryStore()
        return lambda: store
    if request.param == "sqlite":
        return lambda: sa.SQLiteStore(tmp_path / "sessions.db")
    url = request.getfixturevalue("redis_url")
    prefix = f"listing-{uuid.uuid4().hex}"
    return lambda: RedisStore(url, prefix=prefix)


def newest_first(infos: Sequence[sa.SessionInfo]) -> list[str]:
    """The names of ``infos`` in the listing order: updated_at, then name, descending."""
    ordered = sorted(infos, key=lambda i: (i.updated_at, i.session_id), reverse=True)
    return [i.session_id for i in ordered]


async def populate(registry: sa.Registry) -> None:
    """Ten sessions: tier gold for even numbers; s3 and s7 talked to last, s5 hibernated."""
    for i in range(10):
        ref = await registry.spawn(f"s{i}", metadata={"tier": "gold" if i % 2 == 0 else "free"})
        await ref.send(f"hello {i}")
    for name in ("s3", "s7"):
        await registry.ref(name).send("once more")
    await registry.ref("s5").hibernate()


def joined(pages: list[list[str]]) -> list[str]:
    """The pages' names, one list."""
    return [name for page in pages for name in page]


async def pages(registry: sa.Registry, limit: int, **filters: object) -> list[list[str]]:
    """Every page of ``limit`` sessions, each continuing after the last one's name."""
    out: list[list[str]] = []
    after: str | None = None
    while True:
        page = await registry.sessions(limit=limit, after=after, **filters)  # type: ignore[arg-type]
        if not page:
            return out
        out.append([i.session_id for i in page])
        after = page[-1].session_id


async def test_sessions_are_listed_newest_first_in_pages(
    make_store: StoreFactory, echo_agents: dict[str, sa.Agent]
) -> None:
    """sessions() lists newest activity first (name descending on ties); pages of `limit`
    joined with `after` give the whole listing, on every store."""
    async with sa.open_registry(store=make_store(), agents=echo_agents) as registry:
        with trio.fail_after(20):
            await populate(registry)
            everything = await registry.sessions()
            assert len(everything) == 10
            names = [i.session_id for i in everything]
            assert names == newest_first(everything)
            assert names[:2] == ["s7", "s3"]
            assert [len(p) for p in await pages(registry, 3)] == [3, 3, 3, 1]
            assert joined(await pages(registry, 3)) == names
            assert [i.session_id for i in await registry.sessions(after=names[4])] == names[5:]


async def test_a_listing_follows_every_turn_between_listings(
    make_store: StoreFactory, echo_agents: dict[str, sa.Agent]
) -> None:
    """Each listing puts the session talked to last first, whatever was listed before it,
    and a session deleted and made again is listed once, in its new place."""
    async with sa.open_registry(store=make_store(), agents=echo_agents) as registry:
        with trio.fail_after(20):
            for name in ("a", "b", "c"):
                await (await registry.spawn(name)).send("hi")
            for name in ("a", "c", "b", "a", "a", "c"):
                await registry.ref(name).send("again")
                listed = [i.session_id for i in await registry.sessions()]
                assert listed[0] == name
                assert sorted(listed) == ["a", "b", "c"]
            await registry.delete("b")
            await (await registry.spawn("b")).send("back")
            await registry.ref("a").send("last")
            assert [i.session_id for i in await registry.sessions()] == ["a", "b", "c"]


async def test_the_stored_info_follows_the_state_after_every_turn(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """After each durable turn, the info the store holds says what the session's state
    says: its resting status (what another worker or a listing process sees), message
    count, time, metadata (nested too), reviews and usage."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=echo_agents) as registry:
        with trio.fail_after(20):
            meta = {"tier": "gold", "tags": ["a", {"b": 1}], "n": 3}
            ref = await registry.spawn("s", metadata=meta)
            for text in ("one", "two", "three"):
                await ref.send(text)
                state = await ref.state()
                (info,) = [
                    sa.stores.load_info(data)
                    for name, data in await store.list_sessions()
                    if name == "s"
                ]
                assert state.status is sa.Status.IDLE
                assert info == sa.SessionInfo(
                    session_id="s",
                    agent=state.agent,
                    status=state.status,
                    message_count=len(state.messages),
                    updated_at=state.updated_at,
                    metadata=meta,
                    pending_reviews=len(state.reviews),
                    usage=state.usage,
                )


async def test_sessions_filter_by_status_and_metadata(
    make_store: StoreFactory, echo_agents: dict[str, sa.Agent]
) -> None:
    """status= (a Status or its value) and metadata= key=value filters keep the matching
    sessions, in listing order, paged the same way."""
    async with sa.open_registry(store=make_store(), agents=echo_agents) as registry:
        with trio.fail_after(20):
            await populate(registry)
            names = [i.session_id for i in await registry.sessions()]
            gold = [n for n in names if int(n[1:]) % 2 == 0]
            listed = await registry.sessions(metadata={"tier": "gold"})
            assert [i.session_id for i in listed] == gold
            assert joined(await pages(registry, 2, metadata={"tier": "gold"})) == gold
            hibernated = await registry.sessions(status=sa.Status.HIBERNATED)
            assert [i.session_id for i in hibernated] == ["s5"]
            assert [i.session_id for i in await registry.sessions(status="hibernated")] == ["s5"]
            assert await registry.sessions(status="idle", metadata={"tier": "free"}, limit=1)
            assert await registry.sessions(metadata={"tier": "gold", "missing": 1}) == []
            assert await registry.sessions(metadata={}) == await registry.sessions()


async def test_a_stored_session_waiting_on_a_review_is_listed_as_waiting(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    """A session whose turn waits on a review is listed as waiting, and read as waiting
    without waking it, before and after it hibernates and its process restarts; an idle
    one that hibernated is listed as hibernated."""

    @sa.tool(requires_review=True)
    async def refund(order_id: str) -> str:
        """Refund an order."""
        return f"refunded {order_id}"  # pragma: no cover

    call = sa.ToolCall(id="c1", name="refund", arguments='{"order_id": "A1"}')
    agents = {
        "review": sa.Agent(model=ScriptedModel([Scripted(tool_calls=[call])]), tools=[refund]),
        "echo": sa.Agent(model=EchoModel()),
    }

    async def check(registry: sa.Registry, *, live: bool) -> None:
        assert [i.session_id for i in await registry.sessions(status="waiting")] == ["cust"]
        infos = {i.session_id: i for i in await registry.sessions()}
        assert (infos["cust"].status, infos["cust"].pending_reviews) == (sa.Status.WAITING, 1)
        quiet = sa.Status.IDLE if live else sa.Status.HIBERNATED
        assert (infos["quiet"].status, infos["quiet"].pending_reviews) == (quiet, 0)
        assert (await sa.read_session(registry.store, "cust")).status is sa.Status.WAITING
        assert sorted(registry.live()) == (["cust", "quiet"] if live else [])

    with trio.fail_after(20):
        async with sa.open_registry(store=make_store(), agents=agents) as registry:
            await (await registry.spawn("quiet", agent="echo")).send("hi")
            assert (await (await registry.spawn("cust", agent="review")).send("refund")).reviews
            await check(registry, live=True)
            await registry.ref("cust").hibernate()
            await registry.ref("quiet").hibernate()
            await check(registry, live=False)
        async with sa.open_registry(store=make_store(), agents=agents) as registry:
            await check(registry, live=False)


async def test_sessions_refuses_bad_arguments(echo_agents: dict[str, sa.Agent]) -> None:
    """Bad filters raise ValueError or TypeError saying what is accepted; an `after` that is
    not stored raises SessionNotFoundError naming it."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            await registry.spawn("a")
            with pytest.raises(ValueError, match="status must be a Status or one of new"):
                await registry.sessions(status="sleepy")
            for limit in (0, -1, 1.5, True):
                with pytest.raises(ValueError, match="limit must be"):
                    await registry.sessions(limit=limit)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="metadata must be a mapping"):
                await registry.sessions(metadata=[("tier", "gold")])  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="after must be"):
                await registry.sessions(after=3)  # type: ignore[arg-type]
            with pytest.raises(sa.SessionNotFoundError, match=r"'gone'.*list again") as info:
                await registry.sessions(after="gone")
            assert info.value.session_id == "gone"


async def test_a_store_without_list_page_is_listed_whole(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """A store with only list_sessions is still a Store and lists, filters and pages as a
    paged store does, reading every session each time."""
    old = FaultyStore(sa.MemoryStore())  # forwards the Store protocol, not list_page
    assert isinstance(old, sa.stores.Store)
    assert not isinstance(old, sa.stores.PagedStore)
    paged = sa.MemoryStore()
    listings: list[list[list[str]]] = []
    for store in (old, paged):
        async with sa.open_registry(store=store, agents=echo_agents) as registry:
            with trio.fail_after(20):
                await populate(registry)
                listings.append(
                    [
                        [i.session_id for i in await registry.sessions()],
                        joined(await pages(registry, 4)),
                        joined(await pages(registry, 2, metadata={"tier": "free"})),
                    ]
                )
    old_listing, paged_listing = listings
    assert [len(x) for x in old_listing] == [10, 10, 5]
    assert old_listing[0] == old_listing[1]
    assert old.calls["list_sessions"] > 1
    # the same sessions, in the same order relative to each other's activity
    assert sorted(old_listing[0]) == sorted(paged_listing[0])


async def test_unreadable_info_is_listed_from_the_sessions_history(
    tmp_path: Path, echo_agents: dict[str, sa.Agent], caplog: pytest.LogCaptureFixture
) -> None:
    """A session whose stored info (the copy of its status, size and metadata kept for
    listings) was damaged behind the store's back, its history intact, is listed as its
    history says, with a WARNING that says so, not as failed (which invites deleting an
    intact conversation); only one whose history cannot be read either is listed as
    FAILED. The rest of the listing (and its pages) is unaffected."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            for name in ("a", "b", "c", "d"):
                await (await registry.spawn(name, metadata={"n": name})).send("hi")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE sessions SET info = x'c1' WHERE session_id IN ('b', 'd')")
        db.execute("UPDATE snapshots SET data = x'c1' WHERE session_id = 'd'")
    db.close()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            infos = await registry.sessions()
            assert [(i.session_id, i.status) for i in infos] == [
                ("d", sa.Status.FAILED),
                ("c", sa.Status.HIBERNATED),
                ("b", sa.Status.HIBERNATED),
                ("a", sa.Status.HIBERNATED),
            ]
            b = infos[2]
            assert (b.message_count, b.metadata, b.agent) == (2, {"n": "b"}, "echo")
            assert joined(await pages(registry, 1)) == ["d", "c", "b", "a"]
            failed = await registry.sessions(status="failed")
            assert [i.session_id for i in failed] == ["d"]
            told = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            [about_b] = {t for t in told if "'b'" in t}
            assert "history" in about_b, about_b
            assert "delete" not in about_b, about_b
            assert any("'d'" in t and "delete" in t for t in told), told
            # its next write puts the info right
            assert (await registry.ref("b").send("again")).text == "again"
            assert [i.message_count for i in await registry.sessions() if i.session_id == "b"] == [
                4
            ]


async def test_the_pending_review_of_a_session_whose_listing_entry_is_unreadable_is_found(
    tmp_path: Path,
) -> None:
    """registry.pending_reviews() finds the review a session waits on whose stored info
    (which says how many reviews it waits on) was damaged, reading its history without
    waking it (a session left mid-turn would run on)."""
    path = tmp_path / "sessions.db"

    async def refund(order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        return f"refunded {order_id}"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    asked = sa.ToolCall(id="c1", name="refund", arguments='{"order_id": "A1"}')
    model = ScriptedModel([Scripted(text="", tool_calls=[asked]), "done"])
    agents = {"a": sa.Agent(model=model, tools=[tool])}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        with trio.fail_after(10):
            waiting = await (await registry.spawn("r")).send("Refund A1")
            [review] = waiting.reviews
    with sqlite3.connect(path) as db:
        db.execute("UPDATE sessions SET info = x'c1' WHERE session_id = 'r'")
    db.close()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        with trio.fail_after(10):
            assert [r.id for r in await registry.pending_reviews()] == [review.id]
            assert registry.live() == []  # (read, not woken)


async def test_a_session_whose_info_holds_a_time_past_any_date_still_reads_and_wakes(
    tmp_path: Path, echo_agents: dict[str, sa.Agent]
) -> None:
    """A session whose stored info says it was active in a year past 9999 (damaged behind
    the store's back) is read, woken and copied as the rest of its record holds it (its
    time taken from its state), listed as failed: no OverflowError escapes."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            await (await registry.spawn("far")).send("hi")
    with sqlite3.connect(path) as db:
        (blob,) = db.execute("SELECT info FROM sessions WHERE session_id = 'far'").fetchone()
        info = msgpack.unpackb(blob, timestamp=0)
        info["updated_at"] = msgpack.Timestamp(2**40, 0)  # the year 36,812
        db.execute("UPDATE sessions SET info = ? WHERE session_id = 'far'", (msgpack.packb(info),))
    db.close()
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            stored = await sa.read_session(registry.store, "far")
            assert [m.content for m in stored.messages] == ["hi", "hi"]
            assert stored.updated_at.year < 9999
            [listed] = await registry.sessions()  # (as its history says: see above)
            assert (listed.session_id, listed.status) == ("far", sa.Status.HIBERNATED)
            assert (await registry.ref("far").send("again")).text == "again"


async def test_an_older_sqlite_file_is_migrated_and_read_only_lists_unmigrated(
    tmp_path: Path, echo_agents: dict[str, sa.Agent]
) -> None:
    """A schema 1 file (no activity column) lists newest first: read-only as it is, leaving
    its bytes unchanged, and migrated with its index when opened for writing."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            for name in ("b", "a", "c"):
                await (await registry.spawn(name)).send("hi")
            await registry.ref("a").send("again")
    with sqlite3.connect(path) as db:  # back to schema 1, as an older version wrote it
        db.execute("DROP INDEX sessions_by_activity")
        db.execute("ALTER TABLE sessions DROP COLUMN activity")
        db.execute("PRAGMA user_version = 1")
    db.close()
    before = path.read_bytes()
    expected = ["a", "c", "b"]
    async with sa.open_registry(store=sa.SQLiteStore(path, readonly=True)) as registry:
        with trio.fail_after(10):
            assert [i.session_id for i in await registry.sessions()] == expected
            assert joined(await pages(registry, 2)) == expected
    assert path.read_bytes() == before
    async with sa.open_registry(store=sa.SQLiteStore(path)) as registry:
        with trio.fail_after(10):
            assert joined(await pages(registry, 2)) == expected
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (2,)
        plan = " ".join(
            str(row)
            for row in db.execute(
                "EXPLAIN QUERY PLAN SELECT session_id FROM sessions "
                "ORDER BY activity DESC, session_id DESC LIMIT 5"
            )
        )
    db.close()
    assert "sessions_by_activity" in plan
    assert "TEMP B-TREE" not in plan  # read in index order, not sorted


# ---- a registry without agents -------------------------------------------------------------


async def test_a_registry_without_agents_reads_and_manages_a_store(
    tmp_path: Path, echo_agents: dict[str, sa.Agent]
) -> None:
    """open_registry(store=...) without agents lists, reads, changes metadata, spawns and
    deletes; only a turn fails, with AgentNotFoundError naming the session and agents=."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            await (await registry.spawn("kept", metadata={"tier": "free"})).send("hello there")
            await registry.spawn("doomed")
    async with sa.open_registry(store=sa.SQLiteStore(path)) as registry:
        with trio.fail_after(10):
            assert registry.agents == {}
            assert {i.session_id for i in await registry.sessions()} == {"kept", "doomed"}
            ref = registry.ref("kept")
            assert [m.content for m in await ref.history()] == ["hello there", "hello there"]
            assert await ref.set_metadata({"tier": "gold"}) == {"tier": "gold"}
            await registry.delete("doomed")
            await registry.spawn("later", agent="echo", metadata={"tier": "new"})
            with pytest.raises(ValueError, match="say which agent session 'x'"):
                await registry.spawn("x")
            with pytest.raises(sa.AgentNotFoundError, match=r"'kept'.*agents=") as info:
                await ref.send("are you there?")
            assert isinstance(info.value, sa.TurnFailedError)
            assert isinstance(info.value, LookupError)
            assert info.value.session_id == "kept"
            assert len(await ref.history()) == 2  # the refused turn left nothing
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=echo_agents) as registry:
        with trio.fail_after(10):
            infos = {i.session_id: i for i in await registry.sessions()}
            assert set(infos) == {"kept", "later"}
            assert infos["kept"].metadata == {"tier": "gold"}
            assert (await registry.ref("later").send("now")).text == "now"


# ---- set_metadata ------------------------------------------------------------------------


async def test_set_metadata_merges_publishes_and_survives_restarts(
    make_store: StoreFactory, echo_agents: dict[str, sa.Agent]
) -> None:
    """set_metadata merges (None removes a key), publishes MetadataChanged with the whole
    metadata, and the change survives hibernation and a new registry on every store."""
    async with sa.open_registry(store=make_store(), agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s", metadata={"tier": "free", "trial": True})
            async with ref.subscribe() as events:
                merged = await ref.set_metadata({"tier": "gold", "trial": None, "n": [1, 2]})
                event = await events.__anext__()
                while not isinstance(event, sa.MetadataChanged):  # (the wake's StatusChanged)
                    event = await events.__anext__()
            assert merged == {"tier": "gold", "n": [1, 2]}
            assert isinstance(event, sa.MetadataChanged)
            assert event.metadata == merged
            assert (await ref.state()).metadata == merged
            await ref.hibernate()
            assert (await ref.state()).metadata == merged
            await ref.send("hi")
    async with sa.open_registry(store=make_store(), agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = registry.ref("s")
            assert (await ref.state()).metadata == merged
            [info] = await registry.sessions(metadata={"tier": "gold"})
            assert info.metadata == merged
            assert await ref.set_metadata({}) == merged


async def test_set_metadata_refuses_what_cannot_be_stored_before_writing(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """Metadata that is not plain data, or not a mapping, raises TypeError or ValueError
    naming the session and the key, and nothing is journaled or published."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("meta", metadata={"tier": "free"})
            await ref.send("hi")
            seq = (await ref.state()).event_seq
            _, journal = await store.read_journal("meta", 0)
            deep: list[object] = [1]
            for _ in range(100):
                deep = [deep]
            bad: list[tuple[object, type[Exception], str]] = [
                ({"when": object()}, TypeError, r"metadata\['when'\]"),
                ({1: "one"}, TypeError, "keys must be str"),
                (["tier", "gold"], TypeError, "must be a mapping"),
                ({"deep": deep}, ValueError, "nested"),
            ]
            for changes, error, match in bad:
                with pytest.raises(error, match=match) as info:
                    await ref.set_metadata(changes)  # type: ignore[arg-type]
                assert "'meta'" in str(info.value)
            assert (await ref.state()).event_seq == seq
            assert (await ref.state()).metadata == {"tier": "free"}
            assert (await store.read_journal("meta", 0))[1] == journal


async def test_metadata_errors_say_what_is_allowed_once_and_alike_at_spawn(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """spawn(metadata=...) and set_metadata refuse the same values with the same error
    type (a time whose UTC time is out of range too, the caller's error, not a stored
    one), and the message lists what metadata may hold once, not twice."""
    naive = datetime.datetime(2026, 1, 1)
    async with sa.open_registry(agents=echo_agents) as registry:
        ref = await registry.spawn("meta")
        early = datetime.datetime(1, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=5)))
        cases = (
            ({"o": object()}, TypeError),
            ({"t": naive}, ValueError),
            ({"t": early}, ValueError),
        )
        for bad, error in cases:
            with pytest.raises(error) as at_set:
                await ref.set_metadata(bad)
            with pytest.raises(error) as at_spawn:
                await registry.spawn("other", metadata=bad)
            for info in (at_set, at_spawn):
                text = str(info.value)
                assert not isinstance(info.value, sa.SnapshotCorruptError), text
                assert text.count("plain data") <= 1, text
                assert "is a object" not in text
        assert [info.session_id for info in await registry.sessions()] == ["meta"]


async def test_set_metadata_keeps_what_a_restart_reads(echo_agents: dict[str, sa.Agent]) -> None:
    """Metadata set with a tuple (or a mapping of another type) is kept as the store
    gives it back (a list, a dict), as spawn(metadata=...) keeps it: the state and
    the listing read the same before and after hibernation, and a filter on the
    stored form matches at once."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s", metadata={"at_spawn": (1, 2)})
            merged = await ref.set_metadata({"pair": (1, 2), "nested": {"t": ("x",)}})
            expected = {"at_spawn": [1, 2], "pair": [1, 2], "nested": {"t": ["x"]}}
            assert merged == expected
            assert type(merged["pair"]) is list
            assert (await ref.state()).metadata == expected
            [info] = await registry.sessions(metadata={"pair": [1, 2]})
            assert info.metadata == expected
            await ref.hibernate()
            assert (await ref.state()).metadata == expected


class TouchingStore:
    """A store whose first listing page makes ``touch()`` run before it returns (another
    request making a session active while a listing reads the store)."""

    def __init__(self, store: sa.MemoryStore) -> None:
        self._store = store
        self.touch: Callable[[], object] | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        page = await self._store.list_page(after=after, limit=limit)
        touch, self.touch = self.touch, None
        if touch is not None:
            await touch()  # type: ignore[misc]
        return page


async def test_one_listing_never_repeats_a_session_that_became_active_as_it_read(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """A session that becomes active between two of the store's pages of one listing
    call moves to the front; the call goes on after it and lists no session twice."""
    store = TouchingStore(sa.MemoryStore())
    async with sa.open_registry(store=store, agents=echo_agents) as registry:  # type: ignore[arg-type]
        refs = {}
        for i in range(10):  # s9 is the newest; s8..s4 are not "gold"
            gold = i == 9 or i < 4
            refs[i] = await registry.spawn(f"s{i}", metadata={"gold": gold})
            await refs[i].send("hi")
        store.touch = lambda: refs[4].send("again")  # the last of the first page
        listed = [i.session_id for i in await registry.sessions(metadata={"gold": True}, limit=3)]
    assert len(listed) == len(set(listed)), listed
    assert listed == ["s9", "s3", "s2"]


class OnlyListPage(Forwarding):
    """A user's own PagedStore: the Store protocol and list_page, nothing more (no
    list_idle_page), over one of the library's stores."""

    def __init__(self, store: sa.stores.Store) -> None:
        super().__init__(store)
        self.pages = 0

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        self.pages += 1
        assert isinstance(self.inner, sa.stores.PagedStore)
        return await self.inner.list_page(after=after, limit=limit)


async def idle_listings(registry: sa.Registry) -> dict[str, object]:
    """Every listing of the sessions idle since a time that the tests below compare:
    whole, in pages, combined with status and metadata, and after a name."""
    everything = await registry.sessions()
    times = sorted({i.updated_at for i in everything})
    cuts = [times[0], times[3], times[-1], times[-1] + datetime.timedelta(microseconds=1)]
    out: dict[str, object] = {"everything": [i.session_id for i in everything]}
    for n, cut in enumerate(cuts):
        out[f"whole {n}"] = [i.session_id for i in await registry.sessions(active_before=cut)]
        out[f"pages {n}"] = await pages(registry, 2, active_before=cut)
        out[f"gold {n}"] = joined(
            await pages(registry, 2, active_before=cut, metadata={"tier": "gold"})
        )
        out[f"idle {n}"] = [
            i.session_id for i in await registry.sessions(active_before=cut, status="idle", limit=3)
        ]
        out[f"hibernated {n}"] = [
            i.session_id for i in await registry.sessions(active_before=cut, status="hibernated")
        ]
        for name in ("s7", "s1", "s0"):  # (the newest session; older ones)
            page = await registry.sessions(active_before=cut, after=name, limit=4)
            out[f"after {name} {n}"] = [i.session_id for i in page]
    return out


async def test_sessions_active_before_lists_the_idle_sessions_in_pages(
    make_store: StoreFactory, echo_agents: dict[str, sa.Agent]
) -> None:
    """active_before= lists the sessions whose updated_at is before it, in listing order,
    paged with after= (after a session active since: from the first idle one), combined
    with status and metadata, on every store."""
    async with sa.open_registry(store=make_store(), agents=echo_agents) as registry:
        with trio.fail_after(30):
            await populate(registry)
            everything = await registry.sessions()
            listed = await idle_listings(registry)
    times = sorted({i.updated_at for i in everything})
    cuts = [times[0], times[3], times[-1], times[-1] + datetime.timedelta(microseconds=1)]
    names = [i.session_id for i in everything]
    assert listed["everything"] == names
    for n, cut in enumerate(cuts):
        idle = [i.session_id for i in everything if i.updated_at < cut]
        assert listed[f"whole {n}"] == idle
        assert joined(listed[f"pages {n}"]) == idle  # type: ignore[arg-type]
        assert listed[f"gold {n}"] == [s for s in idle if int(s[1:]) % 2 == 0]
        assert listed[f"idle {n}"] == [s for s in idle if s != "s5"][:3]
        assert listed[f"hibernated {n}"] == [s for s in idle if s == "s5"]
        for name in ("s7", "s1", "s0"):
            start = names.index(name) + 1
            assert listed[f"after {name} {n}"] == [s for s in names[start:] if s in idle][:4]
    assert listed["whole 0"] == []
    assert listed["whole 3"] == names
    assert len(listed["whole 1"]) == 3  # type: ignore[arg-type]


async def test_a_paged_store_without_list_idle_page_gives_the_same_idle_listings(
    make_store: StoreFactory, echo_agents: dict[str, sa.Agent]
) -> None:
    """A PagedStore without list_idle_page (a user's own) lists the sessions idle since
    a time as the library's stores do, reading the newer pages and leaving them out."""
    inner = make_store()
    assert isinstance(inner, sa.stores.IdlePageStore)
    own = OnlyListPage(inner)
    assert isinstance(own, sa.stores.PagedStore)
    assert not isinstance(own, sa.stores.IdlePageStore)
    async with sa.open_registry(store=own, agents=echo_agents) as registry:
        with trio.fail_after(30):
            await populate(registry)
            through_pages = await idle_listings(registry)
            async with sa.open_registry(store=make_store()) as reader:  # the same store
                seeking = await idle_listings(reader)
    assert through_pages == seeking
    assert own.pages > 0


class ReadCounting(sa.MemoryStore):
    """A MemoryStore that notes the names its pages hand out."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[str] = []

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        page = await super().list_page(after=after, limit=limit)
        self.read += [name for name, _ in page]
        return page

    async def list_idle_page(
        self, *, active_before: int, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        page = await super().list_idle_page(active_before=active_before, after=after, limit=limit)
        self.read += [name for name, _ in page]
        return page


async def test_sessions_active_before_seeks_past_the_sessions_active_since() -> None:
    """On the library's stores a listing of the sessions idle since a time starts where
    they do and reads none of the sessions active since; through list_page alone it
    reads them all first."""
    store = ReadCounting()
    old = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
    new = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    async with sa.open_registry(store=store) as registry:
        with trio.fail_after(30):
            for i in range(5):
                await make_stored(store, f"old{i}", old + datetime.timedelta(minutes=i))
            for i in range(1200):  # more than the registry reads at a time
                await make_stored(store, f"new{i:04}", new)
            listed = await registry.sessions(active_before=new, limit=2)
            assert [i.session_id for i in listed] == ["old4", "old3"]
            assert store.read == ["old4", "old3"]
            listed = await registry.sessions(active_before=new, after="old3")
            assert [i.session_id for i in listed] == ["old2", "old1", "old0"]
            assert store.read == ["old4", "old3", "old2", "old1", "old0"]
    store.read.clear()
    async with sa.open_registry(store=OnlyListPage(store)) as registry:
        with trio.fail_after(30):
            listed = await registry.sessions(active_before=new, limit=2)
    assert [i.session_id for i in listed] == ["old4", "old3"]
    assert len(store.read) > 1200


async def make_stored(store: sa.MemoryStore, name: str, at: datetime.datetime) -> None:
    """Store a new session ``name`` last active at ``at`` (as a server would have)."""
    state = sa.SessionState(session_id=name, agent=None, created_at=at, updated_at=at)
    info = sa.SessionInfo(
        session_id=name, agent=None, status=sa.Status.IDLE, message_count=0, updated_at=at
    )
    await store.create(name, sa.dump_snapshot(state), sa.stores.dump_info(info))


async def test_sessions_refuses_a_bad_active_before_before_reading_the_store(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """A naive datetime raises ValueError and any other type TypeError, naming
    active_before, and the store is not read."""
    store = FaultyStore(sa.MemoryStore())
    async with sa.open_registry(store=store, agents=echo_agents) as registry:
        with trio.fail_after(10):
            await registry.spawn("a")
            read = store.calls["list_sessions"]
            with pytest.raises(ValueError, match="active_before must be an aware datetime"):
                await registry.sessions(active_before=datetime.datetime(2025, 1, 1))
            for value in ("2025-01-01T00:00:00+00:00", 1735689600, datetime.date(2025, 1, 1)):
                with pytest.raises(TypeError, match="active_before must be an aware datetime"):
                    await registry.sessions(active_before=value)  # type: ignore[arg-type]
            assert store.calls["list_sessions"] == read
            other_zone = datetime.timezone(datetime.timedelta(hours=-5))
            later = datetime.datetime.now(other_zone) + datetime.timedelta(hours=1)
            assert [i.session_id for i in await registry.sessions(active_before=later)] == ["a"]
