"""``python -m sessionactors sessions copy``: every session of a store (or those named)
copied to another store, run as a command against real SQLite files and redis-servers."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import trio

import sessionactors as sa
from processes import reap, sessions
from redis_keys import drop_prefix
from sessionactors.stores import RedisStore, SQLiteStore, Store
from sessionactors.testing import EchoModel, Scripted, ScriptedModel, crash
from test_cli_sessions import digests

#: The call that the session "cust" of ``make_source`` waits to be reviewed.
CALL = sa.ToolCall(id="c1", name="refund", arguments='{"order_id": "A1"}')


def agents(refunded: list[str] | None = None) -> dict[str, sa.Agent]:
    """The agents "echo" and "shop", whose model calls "refund" (reviewed first) and then
    says done; with ``refunded`` (the order ids refunded), a model that says done only
    (its call was made in another process)."""

    async def refund(order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        if refunded is not None:
            refunded.append(order_id)
        return "refunded"

    tool = sa.Tool(
        name="refund", fn=refund, description="Refund.", requires_review=True, idempotent=False
    )
    script: list[Any] = ["done"] if refunded is not None else [Scripted(tool_calls=[CALL]), "done"]
    model = ScriptedModel(script)
    return {"echo": sa.Agent(model=EchoModel()), "shop": sa.Agent(model=model, tools=[tool])}


async def make_source(path: Path, *, spawned: int = 0) -> dict[str, int]:
    """A SQLite store at ``path`` with "a", "b" and "c" (one turn each, metadata with
    bytes), "cust" (its turn waits on a review of ``CALL``), "fresh" (never used) and
    ``spawned`` more, never used ("s-0000", ...); each name with its message count."""
    counts: dict[str, int] = {}
    async with sa.open_registry(store=SQLiteStore(path), agents=agents()) as registry:
        for name in ("a", "b", "c"):
            ref = await registry.spawn(name, agent="echo", metadata={"n": name, "raw": b"\x00"})
            await ref.send(f"hello from {name}")
            counts[name] = 2
        reply = await (await registry.spawn("cust", agent="shop")).send("refund A1")
        assert reply.reviews
        counts["cust"] = 2
        await registry.spawn("fresh", agent="echo", system_prompt="Be brief.")
        counts["fresh"] = 0
        for k in range(spawned):
            await registry.spawn(f"s-{k:04d}", agent="echo")
            counts[f"s-{k:04d}"] = 0
    return counts


async def copy(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sessionactors sessions copy ARGS`` to its end."""
    return await trio.to_thread.run_sync(functools.partial(sessions, "copy", *args))


def copied_lines(counts: dict[str, int]) -> list[str]:
    return sorted(f"copied session {name!r} ({n} messages)" for name, n in counts.items())


async def read_all(store: Store, names: Iterable[str]) -> dict[str, sa.SessionState]:
    try:
        return {name: await sa.read_session(store, name) for name in names}
    finally:
        await store.aclose()


def held(state: sa.SessionState) -> tuple[Any, ...]:
    """What a copy keeps of a session: everything but its status and its store's
    bookkeeping of its journal."""
    return (
        state.session_id,
        state.agent,
        state.messages,
        state.metadata,
        state.reviews,
        state.open_turn,
        state.completed,
        state.turns,
        state.event_seq,
        state.turn_count,
        state.system_prompt,
        state.summary,
        state.usage,
        state.created_at,
        state.updated_at,
    )


def said(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines on stderr, each checked to be the command's own (no traceback)."""
    lines = done.stderr.splitlines()
    assert all(line.startswith("sessionactors sessions copy: ") for line in lines), done.stderr
    return lines


def shard_mate(name: str) -> str:
    """Another name in the shard of ``name`` (``crc32(name) % 1024``, as RedisStore
    shards its sessions)."""
    shard = zlib.crc32(name.encode()) % 1024
    return next(
        mate
        for mate in (f"mate-{k}" for k in itertools.count())
        if zlib.crc32(mate.encode()) % 1024 == shard
    )


# ---- SQLite to Redis ---------------------------------------------------------------


@pytest.mark.redis
async def test_copy_from_sqlite_to_redis_keeps_every_history_and_a_second_run_skips(
    redis_url: str, tmp_path: Path
) -> None:
    """copy stores every session of a SQLite file in Redis as import does (the same
    history, metadata, seq and pending review; hibernated, or waiting on its review),
    one line each on stdout and the counts last; run again, it copies nothing, says on
    stderr that each is there already, and exits with status 1; the copies take turns
    on Redis with their whole history, and the review runs its call once."""
    source = tmp_path / "source.db"
    counts = await make_source(source)
    prefix = f"sa-test-copy-{uuid.uuid4().hex[:12]}"
    to = f"{redis_url}?prefix={prefix}"
    try:
        done = await copy("--store", f"sqlite:///{source}", "--to", to)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        *lines, last = done.stdout.splitlines()
        assert sorted(lines) == copied_lines(counts)
        assert last == "5 copied, 0 skipped, 0 failed"

        before = await read_all(SQLiteStore(source, readonly=True), counts)
        after = await read_all(RedisStore(redis_url, prefix=prefix), counts)
        for name in counts:
            assert held(after[name]) == held(before[name]), name
        assert after["a"].metadata == {"n": "a", "raw": b"\x00"}
        assert [m.content for m in after["a"].messages] == ["hello from a"] * 2
        assert after["a"].status is sa.Status.HIBERNATED
        assert after["fresh"].status is sa.Status.NEW
        assert after["cust"].status is sa.Status.WAITING
        assert [r.tool_call for r in after["cust"].reviews] == [CALL]

        again = await copy("--store", f"sqlite:///{source}", "--to", to)
        assert again.returncode == 0  # (skipped, nothing failed: the copy is complete)
        assert again.stdout == "0 copied, 5 skipped, 0 failed\n"
        skipped = said(again)
        assert len(skipped) == 5, skipped
        for name in counts:
            assert any(f"session {name!r} is already in the store copied to" in s for s in skipped)

        refunded: list[str] = []
        store = RedisStore(redis_url, prefix=prefix)
        async with sa.open_registry(store=store, agents=agents(refunded)) as registry:
            with trio.fail_after(60):
                assert (await registry.ref("a").send("and on")).text == "and on"
                history = [m.content for m in await registry.ref("a").history()]
                assert history == ["hello from a", "hello from a", "and on", "and on"]
                [review] = await registry.pending_reviews()
                assert review.session_id == "cust"
                reply = await registry.ref("cust").review(review.id, approve=True)
                assert reply.text == "done"
        assert refunded == ["A1"]
    finally:
        await drop_prefix(redis_url, prefix)


@pytest.mark.redis
async def test_copy_into_redis_with_workers_running_goes_through_them(
    redis_url: str,
    tmp_path: Path,
    two_redis_workers: Callable[..., AbstractAsyncContextManager[tuple[sa.Registry, sa.Registry]]],
) -> None:
    """Into a Redis store that workers run, copy joins them as import does: a session
    that a worker runs under the same name is skipped (said on stderr as another
    session, status 0) and
    keeps its own history; the others are stored, one in a shard that a worker holds
    (it runs a session of it) included, and the workers serve them with their whole
    history."""
    source = tmp_path / "source.db"
    counts = await make_source(source)
    prefix = f"sa-test-copy-{uuid.uuid4().hex[:12]}"
    try:
        async with two_redis_workers(agents(), prefix=prefix) as (one, two):
            with trio.fail_after(60):
                ref = await two.spawn("b", agent="echo")
                assert (await ref.send("the target's own")).text == "the target's own"
                mate = shard_mate("a")
                await (await two.spawn(mate, agent="echo")).send("holds the shard of a")
                assert {"b", mate} <= set(two.live())
            done = await copy(
                "--store", f"sqlite:///{source}", "--to", f"{redis_url}?prefix={prefix}"
            )
            assert done.returncode == 0, done.stderr
            *lines, last = done.stdout.splitlines()
            del counts["b"]
            assert sorted(lines) == copied_lines(counts)
            assert last == "4 copied, 1 skipped, 0 failed"
            [skipped] = said(done)
            assert "session 'b' in the store copied to is another session" in skipped
            with trio.fail_after(60):
                assert (await one.ref("a").send("and on")).text == "and on"
                history = [m.content for m in await two.ref("a").history()]
                assert history == ["hello from a", "hello from a", "and on", "and on"]
                history = [m.content for m in await one.ref("b").history()]
                assert history == ["the target's own"] * 2
                assert [r.session_id for r in await one.pending_reviews()] == ["cust"]
    finally:
        await drop_prefix(redis_url, prefix)


@pytest.mark.redis
async def test_copy_refuses_the_same_redis_store_and_never_prints_its_password(
    private_redis_server: Callable[..., AbstractContextManager[str]], tmp_path: Path
) -> None:
    """copy refuses, before writing anything, a target whose URL names the same Redis
    store as the source (though written with another user, a ?persistence= or the
    database's default number), naming both with *** for the password; another
    ?prefix= of the same database is another store, copied to (--to-file)."""
    secret = f"pw-{uuid.uuid4().hex}"
    with contextlib.ExitStack() as stack:
        plain = await trio.to_thread.run_sync(
            stack.enter_context, private_redis_server(config=("--requirepass", secret))
        )
        host = plain.removeprefix("redis://").removesuffix("/0")
        url = f"redis://:{secret}@{host}/0"
        async with sa.open_registry(store=RedisStore(url), agents=agents()) as registry:
            await (await registry.spawn("r1", agent="echo")).send("hi")
        to = tmp_path / "to"
        for same in (
            f"redis://default:{secret}@{host}?persistence=everysec",
            f"redis://:{secret}@{host}/0?prefix=sessionactors",
        ):
            to.write_text(same + "\n")
            done = await copy("--store", url, "--to-file", str(to))
            assert done.returncode == 1
            assert done.stdout == ""
            [line] = said(done)
            assert "are the same store, so nothing was copied" in line, line
            assert f"--store 'redis://:***@{host}/0'" in line, line
            assert f"--to-file {str(to)!r} holds" in line, line
            assert secret not in done.stderr
        to.write_text(f"redis://:{secret}@{host}/0?prefix=other\n")
        done = await copy("--store", url, "--to-file", str(to))
        assert done.returncode == 0, done.stderr
        assert done.stdout == "copied session 'r1' (2 messages)\n1 copied, 0 skipped, 0 failed\n"
        state = await read_all(RedisStore(url, prefix="other"), ["r1"])
        assert [m.content for m in state["r1"].messages] == ["hi", "hi"]


@pytest.mark.redis
async def test_a_target_that_refuses_writes_ends_the_copy_with_its_error_and_the_counts(
    private_redis_server: Callable[..., AbstractContextManager[str]], tmp_path: Path
) -> None:
    """A target that refuses every write (a Redis without the persistence the store
    demands) ends the copy: its error in one line on stderr, the counts on stdout,
    status 1, and nothing stored."""
    source = tmp_path / "source.db"
    await make_source(source)
    with contextlib.ExitStack() as stack:
        url = await trio.to_thread.run_sync(
            stack.enter_context, private_redis_server(config=("--appendonly", "no"))
        )
        done = await copy("--store", f"sqlite:///{source}", "--to", url)
        assert done.returncode == 1
        assert done.stdout == "0 copied, 0 skipped, 0 failed\n"
        [line] = said(done)
        assert "appendonly is off" in line, line
        listed = sessions("list", "--json", "--store", url)
        assert json.loads(listed.stdout) == []


# ---- SQLite to SQLite --------------------------------------------------------------


async def test_copy_reads_the_source_page_by_page_and_copies_the_names_given(
    tmp_path: Path,
) -> None:
    """copy of a store holding more sessions than a page of its listing copies each
    once; copy NAME ... copies those only (a name twice, once), and one that the source
    does not hold fails, said on stderr (status 1); the target's file is made, and said."""
    source = tmp_path / "source.db"
    counts = await make_source(source, spawned=520)
    target = tmp_path / "target.db"
    done = await copy(
        "--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}", "a", "cust", "a", "nobody"
    )
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "copied session 'a' (2 messages)",
        "copied session 'cust' (2 messages)",
        "2 copied, 0 skipped, 1 failed",
    ]
    missing, created = said(done)
    assert "not copied: session 'nobody' is not in this store" in missing, missing
    assert f"created a new store at {str(target)!r}" in created, created

    done = await copy("--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}")
    assert done.returncode == 0  # (two skipped, none failed)
    *lines, last = done.stdout.splitlines()
    del counts["a"], counts["cust"]
    assert sorted(lines) == copied_lines(counts)
    assert last == f"{len(counts)} copied, 2 skipped, 0 failed"
    assert len(said(done)) == 2
    listed = sessions("list", "--json", "--store", f"sqlite:///{target}")
    assert len(json.loads(listed.stdout)) == len(counts) + 2


async def copied_then_gone_on(tmp_path: Path, text: str) -> tuple[Path, Path]:
    """``(source, target)``: "a" and "b" of ``make_source`` copied to the target, and
    then "a" sent ``text`` in the source (which goes on after the copy)."""
    source = tmp_path / "source.db"
    await make_source(source)
    target = tmp_path / "target.db"
    done = await copy("--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}", "a", "b")
    assert done.returncode == 0, done.stderr
    async with sa.open_registry(store=SQLiteStore(source), agents=agents()) as registry:
        await registry.ref("a").send(text)
    return source, target


async def test_a_copy_run_again_tells_an_out_of_date_copy_and_another_session_apart(
    tmp_path: Path,
) -> None:
    """Run again, copy skips what the target holds, and says which kind each is: a copy
    whose session took turns in the source since (it is out of date: status 1, with what
    to do), another session that the target holds under the name (no failure), or the
    copy as it is (no failure)."""
    source, target = await copied_then_gone_on(tmp_path, "after the copy")
    async with sa.open_registry(store=SQLiteStore(target), agents=agents()) as registry:
        await registry.spawn("c", agent="echo")  # the target's own "c"
    again = await copy(
        "--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}", "a", "b", "c"
    )
    assert again.returncode == 1, again.stderr
    assert again.stdout == "0 copied, 3 skipped, 0 failed\n"
    stale, same, other = said(again)
    assert "session 'a' in the store copied to is an earlier copy" in stale, stale
    assert "delete it there" in stale, stale
    assert "session 'b' is already in the store copied to; skipped" in same, same
    assert "session 'c' in the store copied to is another session" in other, other


async def test_a_copy_run_again_tells_a_copy_that_went_on_apart_from_its_source(
    tmp_path: Path,
) -> None:
    """A copy whose session took turns in both stores since (a server left writing the
    source after the move) is neither the copy as it is nor merely out of date: each
    store holds turns the other does not. Run again, copy says so, with status 1 and
    what to do; a copy that alone went on is the copy as it is (status 0)."""
    source, target = await copied_then_gone_on(tmp_path, "in the source after the copy")
    async with sa.open_registry(store=SQLiteStore(target), agents=agents()) as registry:
        await registry.ref("a").send("in the copy after the copy")  # (the later of the two)
        await registry.ref("b").send("in the copy alone")
    again = await copy("--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}", "a", "b")
    assert again.returncode == 1, again.stderr
    assert again.stdout == "0 copied, 2 skipped, 0 failed\n", again.stderr
    apart, ahead = said(again)
    assert "session 'a' in the store copied to has gone on apart from the source" in apart, apart
    assert "import --as" in apart, apart
    assert "session 'b' is already in the store copied to" in ahead, ahead


async def test_a_copy_run_again_tells_a_source_edited_after_the_copy_went_on(
    tmp_path: Path,
) -> None:
    """The copy took a turn, and then the source took messages without a turn (which
    no turn id shows): the copy is told out of date by the source's later activity,
    status 1, not the copy as it is."""
    source, target = await copied_then_gone_on(tmp_path, "in the source after the copy")
    async with sa.open_registry(store=SQLiteStore(target), agents=agents()) as registry:
        await registry.ref("b").send("in the copy after the copy")
    async with sa.open_registry(store=SQLiteStore(source), agents=agents()) as registry:
        await registry.ref("b").add_messages([sa.Message.create("user", "added later")])
    again = await copy("--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}", "b")
    assert again.returncode == 1, again.stderr
    [stale] = said(again)
    assert "session 'b' in the store copied to is an earlier copy" in stale, stale


async def test_a_session_cut_off_mid_turn_is_listed_running_once_copied(tmp_path: Path) -> None:
    """A session whose process died while its turn ran a tool that is not idempotent
    (its turn left open in the store) is listed ``running`` in the copy, as in the
    source (the next request resumes it), not ``hibernated``; so is one imported."""
    source = tmp_path / "source.db"
    started, release = trio.Event(), trio.Event()

    async def charge(order_id: str) -> str:
        started.set()
        await release.wait()
        return "charged"

    tool = sa.Tool(name="charge", fn=charge, idempotent=False)
    call = sa.ToolCall(id="c1", name="charge", arguments='{"order_id": "A1"}')
    model = ScriptedModel([Scripted(tool_calls=[call]), "done"])
    with trio.fail_after(30), trio.CancelScope() as process:
        async with sa.open_registry(
            store=SQLiteStore(source), agents={"shop": sa.Agent(model=model, tools=[tool])}
        ) as registry:
            await (await registry.spawn("mid", agent="shop")).submit("charge A1")
            await started.wait()  # (the turn's start is stored before a tool like it runs)
            crash(registry)
            process.cancel()
    target = tmp_path / "target.db"
    done = await copy("--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}")
    assert done.returncode == 0, done.stderr
    exported = sessions("export", "--store", f"sqlite:///{source}", "mid").stdout
    imported = tmp_path / "imported.db"
    assert (
        sessions("import", "--store", f"sqlite:///{imported}", "-", stdin=exported).returncode == 0
    )
    for path in (source, target, imported):
        listed = json.loads(sessions("list", "--json", "--store", f"sqlite:///{path}").stdout)
        assert [(s["name"], s["status"]) for s in listed] == [("mid", "running")], path
    # woken in the new store, it resumes its turn (the tool not run again), as stored
    # cleanly there: no process of the new store died under it
    release.set()
    resumed = {"shop": sa.Agent(model=ScriptedModel(["done", "next"]), tools=[tool])}
    async with sa.open_registry(store=SQLiteStore(target), agents=resumed) as registry:
        with trio.fail_after(30):
            assert (await registry.ref("mid").send("and then?")).text == "next"  # (after it)
            history = [m.content for m in await registry.ref("mid").history()]
        assert registry.statistics().unclean_wakes == 0
    assert history[-3:] == ["done", "and then?", "next"], history


@contextlib.contextmanager
def served(path: Path) -> Iterator[Callable[[str], str]]:
    """A server process on the SQLite file at ``path`` (``sessions_server.py``), ready:
    ``ask(line)`` sends it a command and returns its answer; it exits after the block."""
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "sessions_server.py"), f"sqlite:{path}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None
    assert server.stdout is not None

    def ask(line: str) -> str:
        assert server.stdin is not None
        assert server.stdout is not None
        server.stdin.write(line + "\n")
        server.stdin.flush()
        return server.stdout.readline().strip()

    try:
        assert server.stdout.readline().strip() == "ready"
        yield ask
    finally:
        server.communicate("exit\n", timeout=60)


def test_a_session_live_in_a_server_is_copied_as_far_as_it_is_durable(tmp_path: Path) -> None:
    """copy reads a SQLite file that a server process holds (leaving it byte for byte as
    it was) and copies a session live there as the store held it when read: its turns
    until then, stored hibernated in the target; later turns stay in the source."""
    path = tmp_path / "served.db"
    target = tmp_path / "target.db"
    with served(path) as ask:
        assert ask("spawn a tenant=acme") == "ok"
        assert ask("send a hello") == "hello"
        before = digests(path)
        done = sessions("copy", "--store", f"sqlite:///{path}", "--to", f"sqlite:///{target}")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == "copied session 'a' (2 messages)"
        assert digests(path) == before
        assert ask("send a later") == "later"
        assert ask("live") == "a"

    async def read_back() -> tuple[sa.SessionState, sa.SessionState]:
        copied = await read_all(SQLiteStore(target), ["a"])
        source = await read_all(SQLiteStore(path), ["a"])
        return copied["a"], source["a"]

    copied, source = trio.run(read_back)
    assert copied.status is sa.Status.HIBERNATED
    assert [m.content for m in copied.messages] == ["hello", "hello"]
    assert copied.metadata == {"tenant": "acme"}
    assert [m.content for m in source.messages] == ["hello", "hello", "later", "later"]


def test_a_copy_of_a_source_that_a_server_writes_meanwhile_ends_with_status_1(
    tmp_path: Path,
) -> None:
    """copy of every session of a store that a server writes while it reads (a session
    taking turns throughout) ends with status 1 and says that the target may lack them
    or hold them as they were before, and what to do (it ended 0, and a listing copied
    while its sessions moved may have passed some over)."""
    path = tmp_path / "served.db"
    target = tmp_path / "target.db"
    done: list[subprocess.CompletedProcess[str]] = []
    with served(path) as ask:
        assert ask("spawn a tenant=acme") == "ok"
        copying = threading.Thread(
            target=lambda: done.append(
                sessions("copy", "--store", f"sqlite:///{path}", "--to", f"sqlite:///{target}")
            )
        )
        copying.start()
        while copying.is_alive():  # the session takes turns throughout
            assert ask("send a busy") == "busy"
        copying.join()
    [copied] = done
    assert copied.returncode == 1, copied.stderr
    told = said(copied)[-1]
    assert "1 session of the source was active while it was copied" in told, copied.stderr
    assert "run the copy again" in told, told


async def test_copy_goes_on_past_damaged_sessions_and_says_which(tmp_path: Path) -> None:
    """A session of the source whose snapshot is corrupt, and one whose name damage left
    not UTF-8, are said on stderr (the first with the command that deletes it from the
    source) and counted as failed (status 1); the copy goes on with the others."""
    source = tmp_path / "source.db"
    counts = await make_source(source)
    with contextlib.closing(sqlite3.connect(source)) as conn:
        conn.execute("UPDATE snapshots SET data = ? WHERE session_id = 'b'", (b"\xc1junk",))
        for table in ("sessions", "snapshots", "journal", "leases"):
            conn.execute(
                f"UPDATE {table} SET session_id = CAST(? AS TEXT) WHERE session_id = 'c'",
                (b"\xff19",),
            )
        conn.commit()
    target = tmp_path / "target.db"
    store = f"sqlite:///{source}"
    done = await copy("--store", store, "--to", f"sqlite:///{target}")
    assert done.returncode == 1
    *lines, last = done.stdout.splitlines()
    del counts["b"], counts["c"]
    assert sorted(lines) == copied_lines(counts)
    assert last == "3 copied, 0 skipped, 2 failed"
    lines = said(done)
    [corrupt] = [line for line in lines if "'b'" in line]
    assert "not copied" in corrupt, corrupt
    assert "corrupt" in corrupt, corrupt
    assert f"`python -m sessionactors sessions delete --store {store} --yes b`" in corrupt
    [rotten] = [line for line in lines if "$'\\xff19'" in line]
    assert "not copied" in rotten, rotten
    listed = sessions("list", "--json", "--store", f"sqlite:///{target}")
    assert sorted(r["name"] for r in json.loads(listed.stdout)) == sorted(counts)


async def test_copy_goes_on_past_a_session_too_large_for_one_snapshot(tmp_path: Path) -> None:
    """A session whose history grew past the snapshot limit (a session keeps it, in its
    journal) cannot be written as the one snapshot a copy writes: it is said on stderr,
    with what to do, and counted as failed; the copy goes on with the others."""
    source = tmp_path / "source.db"
    counts = await make_source(source)
    async with sa.open_registry(store=SQLiteStore(source), agents=agents()) as registry:
        big = await registry.spawn("big", agent="echo")
        with trio.fail_after(120):
            for i in range(34):  # each turn 2 MB (the message and its echo): 68 MB
                await big.send(f"{i:02d} " + "x" * (1024 * 1024 - 3))  # (the longest message)
    target = tmp_path / "target.db"
    done = await copy("--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}")
    assert done.returncode == 1
    *lines, last = done.stdout.splitlines()
    assert sorted(lines) == copied_lines(counts)
    assert last == f"{len(counts)} copied, 0 skipped, 1 failed"
    [too_large] = [line for line in said(done) if "'big'" in line]
    assert "not copied" in too_large, too_large
    assert "over the limit" in too_large, too_large


async def test_copy_refuses_the_same_sqlite_file_before_writing(tmp_path: Path) -> None:
    """copy to the source's own file, however its path is written (another spelling, a
    link), is refused in one line and leaves the file byte for byte as it was."""
    source = tmp_path / "source.db"
    await make_source(source)
    (tmp_path / "link.db").symlink_to(source)
    before = digests(source)
    for to in (f"sqlite:///{tmp_path}/./source.db?shared=true", f"sqlite:///{tmp_path}/link.db"):
        done = await copy("--store", f"sqlite:///{source}", "--to", to)
        assert done.returncode == 1
        assert done.stdout == ""
        [line] = said(done)
        assert "are the same store, so nothing was copied" in line, line
        assert digests(source) == before


async def test_copy_without_a_target_or_to_a_url_given_as_a_name_is_refused(
    tmp_path: Path,
) -> None:
    """copy without --to or --to-file, with both, or with a store's URL where a name goes
    (its password as ***) exits with status 2 and one line saying what to give."""
    store = f"sqlite:///{tmp_path}/source.db"
    cases = [
        ([], "pass --to URL or --to-file PATH"),
        (["--to", store, "--to-file", str(tmp_path / "f")], "give --to or --to-file, not both"),
        (["redis://:hush@h:6379/0"], "give the store with --to URL"),
    ]
    for args, words in cases:
        done = await copy("--store", store, *args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert words in done.stderr, done.stderr
        assert "hush" not in done.stderr


async def test_sigint_stops_the_copy_between_two_sessions(tmp_path: Path) -> None:
    """SIGINT stops a copy after the session it copies (status 130, the counts printed,
    said on stderr): every session it said it copied is in the target, and a second run
    copies the rest and skips those."""
    source = tmp_path / "source.db"
    counts = await make_source(source, spawned=300)
    target = tmp_path / "target.db"
    args = ["--store", f"sqlite:///{source}", "--to", f"sqlite:///{target}"]
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "sessionactors", "sessions", "copy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    out = b""
    err = b""
    try:
        with trio.fail_after(60):
            while b"\n" not in out:  # one session is copied
                chunk = await process.stdout.receive_some()
                assert chunk, err
                out += chunk
            process.send_signal(signal.SIGINT)

            async def drain(stream: trio.abc.ReceiveStream) -> bytes:
                data = b""
                while chunk := await stream.receive_some():
                    data += chunk
                return data

            async with trio.open_nursery() as nursery:
                results: dict[str, bytes] = {}

                async def keep(key: str, stream: trio.abc.ReceiveStream) -> None:
                    results[key] = await drain(stream)

                nursery.start_soon(keep, "out", process.stdout)
                nursery.start_soon(keep, "err", process.stderr)
            assert await process.wait() == 130
    finally:
        await reap(process)
    out += results["out"]
    err = results["err"]
    *lines, last = out.decode().splitlines()
    assert last == f"{len(lines)} copied, 0 skipped, 0 failed"
    assert 0 < len(lines) < len(counts)
    assert "stopped before the end; run the copy again" in err.decode(), err
    listed = sessions("list", "--json", "--store", f"sqlite:///{target}")
    names = {r["name"] for r in json.loads(listed.stdout)}
    assert {line.split("'")[1] for line in lines} == names

    done = await copy(*args)
    assert done.returncode == 0
    assert done.stdout.splitlines()[-1] == (
        f"{len(counts) - len(names)} copied, {len(names)} skipped, 0 failed"
    )
