"""Idempotency keys: a key's turn runs once, its reply is kept once (the history's), and
a retry whose reply an edit removed, or that brings other words, is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

import sessionactors as sa
from processes import sessions
from sessionactors.testing import EchoModel, Scripted, ScriptedModel, export_document

GOLDEN = Path(__file__).parent / "golden"
_REPLY_TEXT = "x" * 2048  # (EchoModel: the reply is the user's text)


def _agents() -> dict[str, sa.Agent]:
    return {"echo": sa.Agent(model=EchoModel())}


async def test_a_snapshot_writes_each_keyed_reply_once() -> None:
    """The snapshot of a session whose turns had idempotency keys is barely larger than
    the same session's without keys: a reply the history holds is not written again."""
    sizes = {}
    async with sa.open_registry(agents=_agents()) as registry:
        for keyed in (False, True):
            ref = await registry.spawn(f"keyed-{keyed}")
            for i in range(20):
                await ref.send(f"{i} {_REPLY_TEXT}", idempotency_key=f"key-{i}" if keyed else None)
            sizes[keyed] = len(sa.dump_snapshot(await ref.state()))
    assert sizes[True] < sizes[False] + 20 * 200, sizes


async def test_a_retry_after_a_wake_gets_the_reply_the_history_holds(tmp_path: Path) -> None:
    """A retry whose key's reply is in the history gets that reply (same message and
    turn, replayed) after a hibernation and after a restart, and the woken session's
    completed key holds the very message of its history, not a copy."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=_agents()) as registry:
        ref = await registry.spawn("s")
        first = await ref.send("pay 10", idempotency_key="k1")
        await ref.send("and more")
        await ref.hibernate()
        with trio.fail_after(10):
            turn = await registry.ref("s").submit("pay 10", idempotency_key="k1")
            again = await turn.reply()
        assert turn.replayed
        assert (again.turn_id, again.message) == (first.turn_id, first.message)
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=_agents()) as registry:
        ref = registry.ref("s")
        with trio.fail_after(10):
            woken = await ref.send("pay 10", idempotency_key="k1")
        assert (woken.turn_id, woken.message) == (first.turn_id, first.message)
        state = await ref.state()
        assert len(state.messages) == 4
        (done,) = state.completed
        assert done.reply is state.messages[1]
        assert (done.key, done.turn_id, done.reply_id) == ("k1", first.turn_id, first.message.id)


@pytest.mark.parametrize("edit", ["truncate", "rewind", "replace_history"])
async def test_a_retry_whose_reply_an_edit_removed_is_refused_and_never_runs(
    edit: str, tmp_path: Path
) -> None:
    """After an edit removed a keyed turn's reply from the history, a retry with its key
    raises ReplyRemovedError naming the session, the key and the turn, live and after a
    restart, and runs nothing; the key stays, without its reply."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=_agents()) as registry:
        ref = await registry.spawn("s")
        first = await ref.send("pay 10", idempotency_key="k1")
        await ref.send("and more")
        if edit == "truncate":
            await ref.truncate(2)
        elif edit == "rewind":
            await ref.rewind((await ref.history())[0].id)  # (keeps the user's message)
        else:
            await ref.replace_history((await ref.history())[2:])
        before = await ref.history()
        with pytest.raises(sa.ReplyRemovedError) as refused:
            await ref.send("pay 10", idempotency_key="k1")
        with pytest.raises(sa.ReplyRemovedError):
            await ref.submit("pay 10", idempotency_key="k1")
        with pytest.raises(sa.ReplyRemovedError):
            async with ref.stream("pay 10", idempotency_key="k1"):
                pass
        assert await ref.history() == before
        (done,) = (await ref.state()).completed
        assert (done.key, done.turn_id, done.reply, done.reply_id) == (
            "k1",
            first.turn_id,
            None,
            first.message.id,
        )
    error = refused.value
    assert isinstance(error, LookupError)
    assert (error.session_id, error.turn_id, error.idempotency_key) == ("s", first.turn_id, "k1")
    for part in ("'s'", "'k1'", first.turn_id, "removed", "will not run again"):
        assert part in str(error)
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=_agents()) as registry:
        ref = registry.ref("s")
        with pytest.raises(sa.ReplyRemovedError, match=first.turn_id):
            await ref.send("pay 10", idempotency_key="k1")
        assert await ref.history() == before
        assert (await ref.send("pay 10", idempotency_key="k2")).text == "pay 10"


async def test_replace_history_that_gives_the_reply_back_keeps_its_retry() -> None:
    """replace_history with a history that still holds a keyed reply (given back
    unchanged) keeps the key's retry answered with it, also after a hibernation."""
    async with sa.open_registry(agents=_agents()) as registry:
        ref = await registry.spawn("s")
        first = await ref.send("pay 10", idempotency_key="k1")
        await ref.send("and more")
        await ref.replace_history(await ref.history())
        for _ in range(2):
            again = await ref.send("pay 10", idempotency_key="k1")
            assert (again.turn_id, again.message) == (first.turn_id, first.message)
            await ref.hibernate()
        assert len(await ref.history()) == 4


async def test_truncating_a_session_of_keyed_turns_frees_its_replies() -> None:
    """After truncate(0) and a hibernation, the stored state of a session whose turns had
    keys keeps every key and no reply."""
    store = sa.MemoryStore()
    async with sa.open_registry(store=store, agents=_agents()) as registry:
        ref = await registry.spawn("s")
        for i in range(5):
            await ref.send(f"{i} {_REPLY_TEXT}", idempotency_key=f"key-{i}")
        await ref.truncate(0)
        await ref.hibernate()
        stored = await sa.read_session(store, "s")
    assert [c.key for c in stored.completed] == [f"key-{i}" for i in range(5)]
    assert all(c.reply is None and c.reply_id for c in stored.completed)


async def test_an_export_of_keyed_turns_imports_both_ways(tmp_path: Path) -> None:
    """An export of a session with keys (one reply in the history, one removed) imports,
    and the imported session answers the kept key's retry and refuses the other; so does
    an export written before replies were kept once (which holds both replies whole)."""
    async with sa.open_registry(agents=_agents()) as registry:
        ref = await registry.spawn("keys-now")
        gone = await ref.send("the first words", idempotency_key="gone")
        kept = await ref.send("the second words", idempotency_key="kept")
        await ref.truncate(2)
        document = export_document(await ref.state())
    older = json.loads((GOLDEN / "export_v1_keys.json").read_text())
    replies = []
    for doc in (document, older):
        name = doc["session"]["session_id"]
        target = tmp_path / f"{name}.db"
        done = await trio.to_thread.run_sync(
            lambda doc=doc, target=target: sessions(
                "import", "-", "--store", f"sqlite:///{target}", stdin=json.dumps(doc)
            )
        )
        assert done.returncode == 0, done.stderr
        store = sa.SQLiteStore(target)
        async with sa.open_registry(store=store, agents=_agents()) as registry:
            ref = registry.ref(name)
            history = await ref.history()
            again = await ref.send("the second words", idempotency_key="kept")
            assert again.message == history[1]
            assert again.text == "the second words"
            replies.append(again)
            with pytest.raises(sa.ReplyRemovedError, match="'gone'"):
                await ref.send("the first words", idempotency_key="gone")
            assert await ref.history() == history
            exported = export_document(await ref.state())
        assert exported["session"]["completed"][0]["reply"] is None
    assert (replies[0].turn_id, replies[0].message) == (kept.turn_id, kept.message)
    assert gone.turn_id != kept.turn_id


def _assert_reused(error: BaseException, name: str, key: str, turn_id: str) -> None:
    assert isinstance(error, sa.IdempotencyKeyReusedError), repr(error)
    assert isinstance(error, ValueError)
    assert (error.session_id, error.idempotency_key, error.turn_id) == (name, key, turn_id)
    for part in (repr(name), repr(key), "another message", "new idempotency_key"):
        assert part in str(error), str(error)


async def test_a_completed_key_sent_with_other_words_is_refused_and_runs_nothing(
    tmp_path: Path,
) -> None:
    """A request whose key completed with other words raises IdempotencyKeyReusedError
    naming the session, the key and its turn (send, submit, submit_nowait, stream; live,
    after a hibernation and after a restart) and runs nothing; the same words still get
    the stored reply."""
    path = tmp_path / "sessions.db"
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=_agents()) as registry:
        ref = await registry.spawn("s")
        first = await ref.send("pay alice", idempotency_key="k1")
        before = await ref.history()
        with trio.fail_after(10):
            with pytest.raises(sa.IdempotencyKeyReusedError) as refused:
                await ref.send("pay carol", idempotency_key="k1")
            _assert_reused(refused.value, "s", "k1", first.turn_id)
            with pytest.raises(sa.IdempotencyKeyReusedError):
                await ref.submit("pay carol", idempotency_key="k1")
            with pytest.raises(sa.IdempotencyKeyReusedError):
                ref.submit_nowait("pay carol", idempotency_key="k1")
            with pytest.raises(sa.IdempotencyKeyReusedError):
                async with ref.stream("pay carol", idempotency_key="k1"):
                    pass
            assert await ref.history() == before
            # submit_nowait to a session still waking learns of the key once it is loaded
            await ref.hibernate()
            turn = registry.ref("s").submit_nowait("pay carol", idempotency_key="k1")
            with pytest.raises(sa.IdempotencyKeyReusedError) as refused:
                await turn.reply()
            _assert_reused(refused.value, "s", "k1", first.turn_id)
            again = await ref.send("pay alice", idempotency_key="k1")
            assert (again.turn_id, again.message) == (first.turn_id, first.message)
            assert await ref.history() == before
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=_agents()) as registry:
        ref = registry.ref("s")
        with trio.fail_after(10):
            with pytest.raises(sa.IdempotencyKeyReusedError) as refused:
                await ref.send("pay carol", idempotency_key="k1")
            _assert_reused(refused.value, "s", "k1", first.turn_id)
            assert await ref.history() == before


async def test_a_key_under_way_sent_with_other_words_is_refused_and_the_turn_runs_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A request whose key's turn is running or queued, sent with other words, raises
    IdempotencyKeyReusedError at once; the turn runs once with its own words, and a
    request with the same words joins it."""
    gate = trio.Event()
    model = ScriptedModel([Scripted(text="paid alice", wait=gate), "paid dave"])
    async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            running = await ref.submit("pay alice", idempotency_key="k1")
            queued = await ref.submit("pay dave", idempotency_key="k2")
            await trio.testing.wait_all_tasks_blocked()
            for key, turn in (("k1", running), ("k2", queued)):
                with pytest.raises(sa.IdempotencyKeyReusedError) as refused:
                    await ref.submit("pay carol", idempotency_key=key)
                _assert_reused(refused.value, "s", key, turn.id)
                with pytest.raises(sa.IdempotencyKeyReusedError):
                    ref.submit_nowait("pay carol", idempotency_key=key)
                with pytest.raises(sa.IdempotencyKeyReusedError):
                    async with ref.stream("pay carol", idempotency_key=key):
                        pass
            joined = await ref.submit("pay alice", idempotency_key="k1")
            assert joined.id == running.id
            gate.set()
            assert (await running.reply()).text == "paid alice"
            assert (await queued.reply()).text == "paid dave"
        users = [m.content for m in await ref.history() if m.role is sa.Role.USER]
        assert users == ["pay alice", "pay dave"]
        assert len(model.requests) == 2


async def test_a_key_waiting_on_a_review_sent_with_other_words_is_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A request whose key's turn waits on a review, sent with other words, raises
    IdempotencyKeyReusedError (also after a hibernation); the same words get the
    waiting reply, and the review stays pending."""
    refund_call = sa.ToolCall(id="call_1", name="refund", arguments="{}")
    tool = sa.Tool(name="refund", fn=lambda: "done", requires_review=True, idempotent=False)
    model = ScriptedModel([Scripted(text="Refunding.", tool_calls=[refund_call])])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[tool])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            waiting = await ref.send("refund A1", idempotency_key="k1")
            assert waiting.reviews
            for _ in range(2):
                with pytest.raises(sa.IdempotencyKeyReusedError) as refused:
                    await ref.send("refund B2", idempotency_key="k1")
                _assert_reused(refused.value, "s", "k1", waiting.turn_id)
                again = await ref.send("refund A1", idempotency_key="k1")
                assert (again.turn_id, again.reviews) == (waiting.turn_id, waiting.reviews)
                await ref.hibernate()
            assert [r.id for r in await ref.pending_reviews()] == [waiting.reviews[0].id]


async def test_a_key_whose_turn_runs_on_after_its_review_is_checked_against_its_words(
    autojump_clock: trio.abc.Clock,
) -> None:
    """While the turn of a key runs on after its review was approved, a request with the
    key and other words raises IdempotencyKeyReusedError, and one with the same words
    joins the turn."""
    gate = trio.Event()

    async def refund() -> str:
        await gate.wait()
        return "done"

    refund_call = sa.ToolCall(id="call_1", name="refund", arguments="{}")
    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    model = ScriptedModel([Scripted(text="Refunding.", tool_calls=[refund_call]), "Refunded."])
    async with sa.open_registry(agents={"a": sa.Agent(model=model, tools=[tool])}) as registry:
        ref = await registry.spawn("s")
        with trio.fail_after(10):
            waiting = await ref.send("refund A1", idempotency_key="k1")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ref.review, waiting.reviews[0].id, True)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(sa.IdempotencyKeyReusedError) as refused:
                    await ref.submit("refund B2", idempotency_key="k1")
                _assert_reused(refused.value, "s", "k1", waiting.turn_id)
                joined = await ref.submit("refund A1", idempotency_key="k1")
                assert joined.id == waiting.turn_id
                gate.set()
                assert (await joined.reply()).text == "Refunded."
        users = [m.content for m in await ref.history() if m.role is sa.Role.USER]
        assert users == ["refund A1"]
