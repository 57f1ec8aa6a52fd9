"""An edit that takes text out of a history (replace_history, truncate, rewind, set_summary,
compaction, retry) or a metadata value out of the metadata (set_metadata replacing or
removing a key) is a checkpoint: the snapshot is written with it and the events before it
leave the journal and the replay buffer, in every store and on every worker, so no replay,
no journal read and no stored key hands the removed text out again."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import coredis
import pytest
import trio

import sessionactors as sa
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel, Scripted, ScriptedModel, journal_events

SECRET = "SECRET-CARD-4111"
ECHO = {"echo": sa.Agent(model=EchoModel())}


# ---- what each store holds, read as raw as the store keeps it --------------------------------


class Kept:
    """A store to run the registry on, and a way to read every byte it keeps."""

    def __init__(self, make: Callable[[], sa.stores.Store], raw: Callable[[], Awaitable[bytes]]):
        self.make = make
        self.raw = raw


def _sqlite_bytes(path: Path) -> bytes:
    """Every value of every row of the SQLite file's tables (a reader beside the store)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        out = []
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"'):  # (the file's own table names)
                for value in row:
                    if isinstance(value, bytes):
                        out.append(value)
                    elif isinstance(value, str):
                        out.append(value.encode())
        return b"\n".join(out)
    finally:
        conn.close()


async def _redis_bytes(url: str, prefix: str) -> bytes:
    """Every value under ``prefix``, read by the type of each key."""
    out: list[bytes] = []
    async with coredis.Redis.from_url(url, decode_responses=False) as client:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        for key in keys:
            kind = await client.type(key)
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind == "string":
                value = await client.get(key)
                out.append(bytes(value or b""))
            elif kind == "hash":
                for field, value in (await client.hgetall(key)).items():
                    out += [bytes(field), bytes(value)]
            elif kind == "stream":
                for entry in await client.xrange(key):
                    for field, value in entry.field_values.items():
                        out += [bytes(field), bytes(value)]
            elif kind == "set":
                out += [bytes(m) for m in await client.smembers(key)]
            elif kind == "zset":
                out += [bytes(m) for m in await client.zrange(key, 0, -1)]
            else:  # pragma: no cover (a key of a kind this reader does not know)
                raise AssertionError(f"key {key!r} is a {kind}")
    return b"\n".join(out)


@pytest.fixture(params=["memory", "sqlite", "redis"])
def kept(request: pytest.FixtureRequest, tmp_path: Path) -> Kept:
    if request.param == "memory":
        store = sa.MemoryStore()

        async def memory_bytes() -> bytes:  # what a new process would read of it
            data = [entry.data for entry in (await store.read_journal("s", 0))[1]]
            stored = await store.load("s")
            assert stored is not None
            return b"\n".join([stored.snapshot, *data, *(e.data for e in stored.entries)])

        return Kept(lambda: store, memory_bytes)
    if request.param == "sqlite":
        path = tmp_path / "s.db"

        async def file_bytes() -> bytes:
            return await trio.to_thread.run_sync(_sqlite_bytes, path)

        return Kept(lambda: sa.SQLiteStore(path), file_bytes)
    url: str = request.getfixturevalue("redis_url")
    prefix = f"sa-test:{uuid.uuid4().hex}"
    return Kept(lambda: RedisStore(url, prefix=prefix), lambda: _redis_bytes(url, prefix))


# ---- the edits ---------------------------------------------------------------------------------


async def replace_history(ref: sa.SessionRef) -> None:
    """A redacted copy: every message without the secret."""
    await ref.send(f"my card is {SECRET}")
    await ref.send("thanks")
    await ref.replace_history([m for m in await ref.history() if SECRET not in m.content])


async def truncate(ref: sa.SessionRef) -> None:
    await ref.send(f"my card is {SECRET}")
    await ref.send("thanks")
    assert await ref.truncate(2) == 2


async def rewind(ref: sa.SessionRef) -> None:
    await ref.send("hello")
    await ref.send(f"my card is {SECRET}")
    assert await ref.rewind((await ref.history())[1].id) == 2


async def set_summary(ref: sa.SessionRef) -> None:
    await ref.send("hello")
    await ref.set_summary(f"the user's card is {SECRET}")
    await ref.send("and now?")
    await ref.set_summary("the user gave a card number")


EDITS: dict[str, Callable[[sa.SessionRef], Awaitable[None]]] = {
    "replace_history": replace_history,
    "truncate": truncate,
    "rewind": rewind,
    "set_summary": set_summary,
}


# ---- the checks --------------------------------------------------------------------------------


async def replayed(ref: sa.SessionRef, after: int, until: str) -> list[sa.Event]:
    """The events ``subscribe(after=...)`` replays, up to the outcome of turn ``until``."""
    got: list[sa.Event] = []
    with trio.fail_after(20):
        async with ref.subscribe(after=after) as events:
            async for event in events:
                got.append(event)
                if isinstance(event, sa.TurnFinished) and event.turn_id == until:
                    return got
    raise AssertionError(f"the replay ended before turn {until}: {got!r}")


async def check_erased(ref: sa.SessionRef, store: sa.stores.Store, edited: int, last: str) -> None:
    """Nothing before the edit (the session's seq ``edited`` as the edit left it) is
    replayed or kept in the journal; the replay after it works; ``last``: a turn after it."""
    assert not any(SECRET in m.content for m in await ref.history())
    assert SECRET not in ((await ref.state()).summary or "")
    with pytest.raises(sa.EventsExpiredError) as caught:
        await replayed(ref, 0, last)
    assert caught.value.session_id == "s"
    assert caught.value.oldest_seq is not None
    assert 1 < caught.value.oldest_seq <= edited + 1
    after = await replayed(ref, edited, last)
    assert after[0].seq > edited
    assert not [e for e in after if SECRET in repr(e)]
    assert not [e for e in await journal_events(store, "s") if SECRET in repr(e)]
    trimmed, _ = await store.read_journal("s", 0)
    assert trimmed >= caught.value.oldest_seq - 1


@pytest.mark.parametrize("edit", list(EDITS))
async def test_an_edit_erases_what_it_removed_from_replay_and_store(kept: Kept, edit: str) -> None:
    """After the edit, subscribe(after=0) raises EventsExpiredError (live and once
    hibernated), a subscription after the edit's seq replays what followed, and neither
    the journal nor any byte the store keeps holds the removed text; a subscriber that
    was live before the edit got its HistoryEdited."""
    store = kept.make()
    seen: list[sa.Event] = []
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(20):
            async with ref.subscribe() as live:
                await EDITS[edit](ref)
                edited = (await ref.state()).event_seq
                async for event in live:
                    seen.append(event)
                    if event.seq >= edited:
                        break
        assert [e for e in seen if isinstance(e, sa.HistoryEdited)][-1].seq <= edited
        last = (await ref.send("after the edit")).turn_id
        await check_erased(ref, store, edited, last)  # live: from memory, then the store
        assert SECRET.encode() not in await kept.raw()
        await ref.hibernate()
        await check_erased(ref, store, edited, last)  # from the store
        assert SECRET.encode() not in await kept.raw()
    async with sa.open_registry(store=kept.make(), agents=ECHO) as registry:
        ref = registry.ref("s")
        await check_erased(ref, registry.store, edited, last)  # another process
        assert SECRET.encode() not in await kept.raw()


async def test_compaction_erases_the_messages_it_summarized(kept: Kept) -> None:
    """A compaction takes the summarized messages out of the journal and the replay too,
    once the turn that compacted ends; the turns after it replay."""
    summarizer = ScriptedModel(["A summary."], repeat=True)
    compaction = sa.Compaction(max_tokens=60, keep_last=2, summarizer=summarizer)
    agents = {"echo": sa.Agent(model=EchoModel(), compaction=compaction)}
    store = kept.make()
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(20):
            await ref.send(f"my card is {SECRET}, in a long long long message")
            while any(SECRET in m.content for m in await ref.history()):
                await ref.send("more words to fill the context")
        assert summarizer.requests
        edited = (await ref.state()).event_seq
        last = (await ref.send("after the compaction")).turn_id
        await check_erased(ref, store, edited, last)
        assert SECRET.encode() not in await kept.raw()
        await ref.hibernate()
        await check_erased(ref, store, edited, last)
    assert SECRET.encode() not in await kept.raw()


async def test_a_retry_erases_the_failed_attempt_it_removed(kept: Kept) -> None:
    """A retry removes what the failed attempt left (its partial reply): that is erased
    from the journal and the replay too, once the retried turn is written."""
    failing = Scripted(text=f"your card is {SECRET}", error=RuntimeError("the model fell over"))
    model = ScriptedModel([failing, "all is well", "after the retry"])
    store = kept.make()
    async with sa.open_registry(store=store, agents={"m": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(20):
            with pytest.raises(sa.TurnFailedError):
                await ref.send("hello")
            assert any(SECRET in m.content for m in await ref.history())
            assert SECRET.encode() in await kept.raw()
            assert (await ref.retry()).text == "all is well"
            edited = (await ref.state()).event_seq
            last = (await ref.send("and now")).turn_id
        await check_erased(ref, store, edited, last)
        assert SECRET.encode() not in await kept.raw()


class QuotingModel:
    """A model whose provider refuses a message that begins "fail" with an error that
    quotes the whole prompt (as providers' errors may), and echoes any other."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        said = [m.content for m in request.messages]
        if said[-1].startswith("fail"):
            raise RuntimeError(f"400 content policy violation for prompt: {said!r}")
        yield sa.TextChunk(said[-1])


async def failing_turn_then(ref: sa.SessionRef, edit: str) -> str:
    """A turn that fails quoting the secret, more turns, then ``edit``, which removes the
    failed turn's user message; the failed turn's id."""
    await ref.send("hello")
    with pytest.raises(sa.TurnFailedError):
        await ref.send(f"fail: my card is {SECRET}")
    failed = (await ref.state()).turns[-1]
    assert SECRET in (failed.error or "")
    await ref.send("thanks")
    history = await ref.history()
    if edit == "replace_history":
        await ref.replace_history(
            [m for m in history if SECRET not in m.content and m.interrupted is False]
        )
    elif edit == "truncate":
        assert await ref.truncate(2) == 4
    else:
        assert await ref.rewind(history[1].id) == 4
    return failed.turn_id


@pytest.mark.parametrize("edit", ["replace_history", "truncate", "rewind"])
async def test_an_edit_erases_what_a_removed_turns_error_quoted(kept: Kept, edit: str) -> None:
    """A failed turn's error may quote its user's message (a provider refusing it): an
    edit that removes that message takes the error's words out of the turn's record too
    (``turn_outcome``, ``state().turns``, the store), keeping that the turn failed and the
    error's kind."""
    store = kept.make()
    agents = {"q": sa.Agent(model=QuotingModel())}
    async with sa.open_registry(store=store, agents=agents) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(20):
            turn_id = await failing_turn_then(ref, edit)
            for _ in range(2):  # live, then woken from the store
                told = await ref.turn_outcome(turn_id)
                assert told.status is sa.TurnStatus.FAILED
                assert (told.error or "").startswith("RuntimeError: (what it said went with")
                assert SECRET not in told.error, told.error
                assert SECRET not in repr((await ref.state()).turns)
                assert SECRET.encode() not in await kept.raw()
                await ref.hibernate()
    async with sa.open_registry(store=kept.make(), agents=agents) as registry:
        told = await registry.ref("s").turn_outcome(turn_id)
        assert told.status is sa.TurnStatus.FAILED
        assert SECRET not in (told.error or ""), told.error


async def test_an_edit_erases_what_a_kept_turns_error_quoted_of_the_messages_before(
    kept: Kept,
) -> None:
    """A failed turn's error may quote the whole prompt, the history before its own
    message included: an edit that removes earlier messages takes the words of the
    errors of the turns after them too, though their own messages stay."""
    store = kept.make()
    async with sa.open_registry(store=store, agents={"q": sa.Agent(model=QuotingModel())}) as r:
        ref = await r.spawn("s")
        with trio.fail_after(20):
            await ref.send(f"my card is {SECRET}")
            await ref.send("hello")
            with pytest.raises(sa.TurnFailedError):
                await ref.send("fail now")
            failed = (await ref.state()).turns[-1]
            assert SECRET in (failed.error or "")
            assert await ref.truncate(4) == 2  # the secret's turn goes, the failed one stays
            assert [m.content for m in await ref.history()][2] == "fail now"
            told = await ref.turn_outcome(failed.turn_id)
            assert told.status is sa.TurnStatus.FAILED
            assert SECRET not in (told.error or ""), told.error
            assert SECRET.encode() not in await kept.raw()


async def test_without_a_journal_the_edit_writes_the_snapshot_at_once(tmp_path: Path) -> None:
    """With durability="hibernate" (nothing journaled per turn), an edit still writes the
    snapshot at once: the store no longer holds the removed text the session had when
    it last hibernated, and memory replays nothing before the edit."""
    path = tmp_path / "s.db"
    async with sa.open_registry(
        store=sa.SQLiteStore(path), agents=ECHO, durability="hibernate"
    ) as registry:
        ref = await registry.spawn("s")
        await ref.send(f"my card is {SECRET}")
        await ref.hibernate()
        assert SECRET.encode() in await trio.to_thread.run_sync(_sqlite_bytes, path)
        await ref.send("thanks")
        await ref.truncate(2)
        assert SECRET.encode() not in await trio.to_thread.run_sync(_sqlite_bytes, path)
        edited = (await ref.state()).event_seq
        last = (await ref.send("after the edit")).turn_id
        with pytest.raises(sa.EventsExpiredError):
            await replayed(ref, 0, last)
        assert not [e for e in await replayed(ref, edited, last) if SECRET in repr(e)]


# ---- metadata ----------------------------------------------------------------------------------

#: The changes of set_metadata that take the value of "email" out of the metadata.
METADATA_CHANGES: dict[str, dict[str, Any]] = {
    "replace": {"email": "ada@example.com"},
    "remove": {"email": None},
}


async def check_metadata_erased(
    ref: sa.SessionRef, store: sa.stores.Store, edited: int, last: str, metadata: dict[str, Any]
) -> None:
    """As ``check_erased``, and the session keeps ``metadata`` and its whole history."""
    await check_erased(ref, store, edited, last)
    state = await ref.state()
    assert state.metadata == metadata
    users = [m.content for m in state.messages if m.role is sa.Role.USER]
    assert users == ["hello", "thanks", "after the change"]


@pytest.mark.parametrize("change", list(METADATA_CHANGES))
async def test_a_metadata_change_erases_the_value_it_replaced_or_removed(
    kept: Kept, change: str
) -> None:
    """A set_metadata that replaces or removes a key's value is a checkpoint: after it,
    subscribe(after=0) raises EventsExpiredError (live, once hibernated, in another
    process), and neither the journal nor any byte the store keeps holds the old value;
    the history and the other keys stay, and a subscriber that was live got a
    MetadataChanged naming the key replaced."""
    store = kept.make()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("s", metadata={"tenant": "acme"})
        with trio.fail_after(20):
            await ref.send("hello")
            await ref.set_metadata({"email": SECRET})
            await ref.send("thanks")
            assert SECRET.encode() in await kept.raw()  # (it was stored)
            async with ref.subscribe() as live:
                metadata = await ref.set_metadata(METADATA_CHANGES[change])
                async for event in live:
                    if isinstance(event, sa.MetadataChanged):
                        changed = event
                        break
        expected = {"tenant": "acme"} | (
            {"email": "ada@example.com"} if change == "replace" else {}
        )
        assert metadata == expected
        edited = (await ref.state()).event_seq
        last = (await ref.send("after the change")).turn_id
        await check_metadata_erased(ref, store, edited, last, expected)  # live
        assert SECRET.encode() not in await kept.raw()
        await ref.hibernate()
        await check_metadata_erased(ref, store, edited, last, expected)  # from the store
        assert SECRET.encode() not in await kept.raw()
        assert (changed.metadata, changed.replaced) == (expected, ("email",))
    async with sa.open_registry(store=kept.make(), agents=ECHO) as registry:
        ref = registry.ref("s")
        await check_metadata_erased(ref, registry.store, edited, last, expected)  # another process
        assert SECRET.encode() not in await kept.raw()


async def test_a_metadata_change_that_takes_no_value_out_is_no_checkpoint(kept: Kept) -> None:
    """A set_metadata that only adds keys, sets a key to the value it has, or removes a
    key the metadata lacks is journaled as before: nothing is erased, subscribe(after=0)
    replays from the session's first event, and the MetadataChanged names no key."""
    store = kept.make()
    async with sa.open_registry(store=store, agents=ECHO) as registry:
        ref = await registry.spawn("s", metadata={"tenant": "acme"})
        with trio.fail_after(20):
            first = (await ref.send("hello")).turn_id
            await ref.set_metadata({"email": SECRET})
            await ref.set_metadata({"tenant": "acme", "email": SECRET, "absent": None})
            last = (await ref.send("thanks")).turn_id
        replay = await replayed(ref, 0, last)
        assert isinstance(replay[0], sa.StatusChanged)
        assert replay[0].status is sa.Status.NEW
        assert [e.turn_id for e in replay if isinstance(e, sa.TurnStarted)] == [first, last]
        changes = [e for e in replay if isinstance(e, sa.MetadataChanged)]
        assert [e.replaced for e in changes] == [(), ()]
        assert SECRET.encode() in await kept.raw()
        await ref.hibernate()
        assert (await replayed(ref, 0, last))[0].seq == replay[0].seq
        assert len([e for e in await journal_events(store, "s") if SECRET in repr(e)]) == 2


async def test_a_metadata_change_names_the_keys_whose_value_it_took_out() -> None:
    """MetadataChanged.replaced names the keys removed or set to another value (of
    another type too: True is not 1), in the order given; not a key set to the same
    value, one added, or one removed that was not there."""
    async with sa.open_registry(agents=ECHO) as registry:
        ref = await registry.spawn("s", metadata={"a": 1, "b": [1, {"c": "x"}], "c": "k"})
        with trio.fail_after(10):
            async with ref.subscribe() as events:
                await ref.set_metadata(
                    {"c": None, "b": [1, {"c": "x"}], "a": True, "d": 5, "z": None}
                )
                async for event in events:
                    if isinstance(event, sa.MetadataChanged):
                        break
        assert event.replaced == ("c", "a")
        assert event.metadata == {"a": True, "b": [1, {"c": "x"}], "d": 5}


# ---- two workers ---------------------------------------------------------------------------


class Reader:
    """Reads a live subscription into a list; ``wait_for`` an event that matches."""

    def __init__(self) -> None:
        self.events: list[sa.Event] = []
        self._changed = trio.Event()

    async def run(self, ref: sa.SessionRef, task_status: trio.TaskStatus[None]) -> None:
        async with ref.subscribe(after=0) as events:
            task_status.started()
            async for event in events:
                self.events.append(event)
                self._changed.set()
                self._changed = trio.Event()

    async def wait_for(self, match: Callable[[sa.Event], Any]) -> None:
        while not any(match(e) for e in self.events):
            await self._changed.wait()


@pytest.mark.redis
async def test_an_edit_erases_what_another_worker_mirrors(
    redis_url: str,
    two_redis_workers: Callable[..., AbstractAsyncContextManager[tuple[sa.Registry, sa.Registry]]],
) -> None:
    """With a subscriber on another worker (the session's events go through its Redis
    event stream to a mirror there), after the edit neither worker replays the removed
    text (EventsExpiredError from after=0), and no key under the prefix holds it, the
    event stream included."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with two_redis_workers(ECHO, prefix) as (a, b), trio.open_nursery() as nursery:
            owner = await a.spawn("s")
            await owner.send("hello")
            reader = Reader()
            await nursery.start(reader.run, b.ref("s"))
            secret = (await owner.send(f"my card is {SECRET}")).turn_id
            await reader.wait_for(lambda e: isinstance(e, sa.TurnFinished) and e.turn_id == secret)
            assert SECRET.encode() in await _redis_bytes(redis_url, prefix)  # the stream has it
            assert await b.ref("s").rewind((await owner.history())[1].id) == 2
            await reader.wait_for(lambda e: isinstance(e, sa.HistoryEdited))
            edited = (await owner.state()).event_seq
            last = (await b.ref("s").send("after the edit")).turn_id
            await reader.wait_for(lambda e: isinstance(e, sa.TurnFinished) and e.turn_id == last)
            assert (a.live(), b.live()) == (["s"], [])
            for ref in (a.ref("s"), b.ref("s")):
                with pytest.raises(sa.EventsExpiredError):
                    await replayed(ref, 0, last)
                after = await replayed(ref, edited, last)
                assert not [e for e in after if SECRET in repr(e)]
            assert SECRET.encode() not in await _redis_bytes(redis_url, prefix)
            nursery.cancel_scope.cancel()


@pytest.mark.redis
async def test_a_metadata_change_erases_the_value_another_worker_mirrors(
    redis_url: str,
    two_redis_workers: Callable[..., AbstractAsyncContextManager[tuple[sa.Registry, sa.Registry]]],
) -> None:
    """With a subscriber on another worker, a set_metadata that removes a key (asked
    through that worker) leaves its old value in neither worker's replay
    (EventsExpiredError from after=0) and in no key under the prefix, the event stream
    included; the metadata and the history stay."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with two_redis_workers(ECHO, prefix) as (a, b), trio.open_nursery() as nursery:
            owner = await a.spawn("s", metadata={"tenant": "acme"})
            await owner.send("hello")
            reader = Reader()
            await nursery.start(reader.run, b.ref("s"))
            await owner.set_metadata({"email": SECRET})
            await reader.wait_for(
                lambda e: isinstance(e, sa.MetadataChanged) and "email" in e.metadata
            )
            await owner.send("thanks")
            assert SECRET.encode() in await _redis_bytes(redis_url, prefix)  # the stream has it
            assert await b.ref("s").set_metadata({"email": None}) == {"tenant": "acme"}
            await reader.wait_for(
                lambda e: isinstance(e, sa.MetadataChanged) and "email" not in e.metadata
            )
            edited = (await owner.state()).event_seq
            last = (await b.ref("s").send("after the change")).turn_id
            await reader.wait_for(lambda e: isinstance(e, sa.TurnFinished) and e.turn_id == last)
            assert (a.live(), b.live()) == (["s"], [])
            for ref in (a.ref("s"), b.ref("s")):
                with pytest.raises(sa.EventsExpiredError):
                    await replayed(ref, 0, last)
                after = await replayed(ref, edited, last)
                assert not [e for e in after if SECRET in repr(e)]
                state = await ref.state()
                assert state.metadata == {"tenant": "acme"}
                assert [m.content for m in state.messages if m.role is sa.Role.USER] == [
                    "hello",
                    "thanks",
                    "after the change",
                ]
            assert SECRET.encode() not in await _redis_bytes(redis_url, prefix)
            nursery.cancel_scope.cancel()
