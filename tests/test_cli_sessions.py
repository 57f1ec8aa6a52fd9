"""``python -m sessionactors sessions ...``, run as a command against real stores, beside
a server process that uses the same store."""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import itertools
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import attrs
import coredis
import pytest
import trio

import sessionactors as sa
import unusable_stores
from processes import reap, sessions, unprivileged
from redis_keys import drop_prefix, keys_of, rot_name
from redis_workers import open_worker
from sessionactors.stores import RedisStore, SQLiteStore
from sessionactors.testing import EchoModel, Scripted, ScriptedModel, crash, export_document

HERE = Path(__file__).resolve().parent
SERVER = HERE / "sessions_server.py"


def ok(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    done = sessions(*args, stdin=stdin, env=env)
    assert done.returncode == 0, done.stderr
    # (nothing on stderr but, for an import into a file that was not there, a note of it)
    assert all("created a new store at" in line for line in done.stderr.splitlines())
    return done.stdout


def refused(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    """The one line on stderr of a command that fails (and prints no traceback)."""
    done = sessions(*args, stdin=stdin, env=env)
    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.endswith("\n")
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


class Server:
    """A process holding sessions on a store (tests/sessions_server.py)."""

    def __init__(self, spec: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.receive() == "ready"

    def receive(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.receive()

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.ask("exit")
        try:
            self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    stream.close()


@contextlib.contextmanager
def serving(spec: str) -> Iterator[Server]:
    server = Server(spec)
    try:
        yield server
    finally:
        server.stop()


def populate(server: Server) -> None:
    """Three sessions: ``a`` (acme), ``b`` (globex), ``c`` (acme), with activity in that order."""
    for name, tenant in (("a", "acme"), ("b", "globex"), ("c", "acme")):
        assert server.ask(f"spawn {name} tenant={tenant}") == "ok"
        assert server.ask(f"send {name} hello from {name}") == f"hello from {name}"


def digests(path: Path) -> dict[str, str | None]:
    """The bytes of the database, its -wal and its -shm (None: absent)."""
    out: dict[str, str | None] = {}
    for suffix in ("", "-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        out[suffix] = hashlib.sha256(side.read_bytes()).hexdigest() if side.exists() else None
    return out


# ---- reading beside a server -------------------------------------------------------


def test_read_commands_leave_a_served_store_byte_for_byte_unchanged(tmp_path: Path) -> None:
    """list, show, export and tail read a SQLite store that a server process holds open
    (exclusively, as by default), and leave its file, -wal and -shm byte for byte as they
    were, each time after the server wrote."""
    path = tmp_path / "served.db"
    store = f"sqlite:///{path}"
    with serving(f"sqlite:{path}") as server:
        populate(server)
        reads = [
            ["list", "--store", store],
            ["list", "--store", store, "--json", "--meta", "tenant=acme"],
            ["show", "a", "--store", store],
            ["show", "a", "--store", store, "--json", "--events"],
            ["export", "a", "--store", store],
            ["tail", "a", "--store", store, "--after", "0", "--no-follow"],
        ]
        for i, args in enumerate(reads):
            assert server.ask(f"send b turn {i}") == f"turn {i}"  # new WAL frames
            before = digests(path)
            assert before["-shm"] is not None
            ok(*args)
            assert digests(path) == before, args
        assert Path(f"{path}.lock").exists()  # still the server's


def test_list_orders_filters_and_pages(tmp_path: Path) -> None:
    """list shows the newest activity first, filters by status and metadata, and pages
    with --limit and --after; --json gives name, status, message_count, updated_at and
    metadata."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    with serving(f"sqlite:{path}") as server:
        populate(server)
        rows = json.loads(ok("list", "--store", store, "--json"))
        assert [r["name"] for r in rows] == ["c", "b", "a"]
        assert {"name", "status", "message_count", "updated_at", "metadata"} <= set(rows[0])
        assert rows[0]["message_count"] == 2
        assert rows[0]["metadata"] == {"tenant": "acme"}
        acme = json.loads(ok("list", "--store", store, "--json", "--meta", "tenant=acme"))
        assert [r["name"] for r in acme] == ["c", "a"]
        assert json.loads(ok("list", "--store", store, "--json", "--meta", "tenant=x")) == []
        page = json.loads(ok("list", "--store", store, "--json", "--limit", "2"))
        assert [r["name"] for r in page] == ["c", "b"]
        rest = json.loads(ok("list", "--store", store, "--json", "--after", "b"))
        assert [r["name"] for r in rest] == ["a"]
        status = rows[0]["status"]
        same = json.loads(ok("list", "--store", store, "--json", "--status", status))
        assert "c" in [r["name"] for r in same]
        text = ok("list", "--store", store).splitlines()
        assert [line.split("\t")[0] for line in text] == ["c", "b", "a"]
        assert "after" in refused("list", "--store", store, "--after", "nobody")
        # (told by what the error advises, not by words of the message: a name may hold them)
        assert "given as after=" in refused("list", "--store", store, "--after", "registry.spawn(")


async def _store_aged(path: Path, ages: dict[str, datetime.timedelta]) -> None:
    """A SQLite store of sessions, each last active that long ago (as a server left them)."""
    now = datetime.datetime.now(datetime.UTC)
    store = sa.SQLiteStore(path)
    try:
        for name, age in ages.items():
            at = now - age
            state = sa.SessionState(session_id=name, agent=None, created_at=at, updated_at=at)
            info = sa.SessionInfo(
                session_id=name, agent=None, status=sa.Status.IDLE, message_count=0, updated_at=at
            )
            await store.create(name, sa.dump_snapshot(state), sa.stores.dump_info(info))
    finally:
        await store.aclose()


def test_list_active_before_finds_the_idle_sessions_to_delete(tmp_path: Path) -> None:
    """list --active-before (a duration before now, or an ISO 8601 time with an offset)
    lists the sessions last active before it, newest first, with --limit and --after;
    their names given to delete --yes leave the others (the retention recipe). A time
    without an offset is refused in one line, status 2."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    day = datetime.timedelta(days=1)
    ages = {"new": day, "month": 30 * day, "old": 91 * day, "older": 200 * day, "x": 400 * day}
    trio.run(_store_aged, path, ages)

    def names(*args: str) -> list[str]:
        return [r["name"] for r in json.loads(ok("list", "--store", store, "--json", *args))]

    assert names("--active-before", "90d") == ["old", "older", "x"]
    assert names("--active-before", "2160h") == ["old", "older", "x"]
    assert names("--active-before", "90d", "--limit", "2") == ["old", "older"]
    assert names("--active-before", "90d", "--after", "older") == ["x"]
    assert names("--active-before", "90d", "--after", "new") == ["old", "older", "x"]
    assert names("--active-before", "1000d") == []
    when = datetime.datetime.now(datetime.UTC) - 100 * day
    assert names("--active-before", when.isoformat()) == ["older", "x"]
    zulu = when.astimezone(datetime.timezone(datetime.timedelta(hours=5)))
    assert names("--active-before", zulu.isoformat()) == ["older", "x"]
    assert names("--active-before", when.strftime("%Y-%m-%dT%H:%M:%SZ")) == ["older", "x"]
    idle = names("--active-before", "90d")
    ok("delete", "--store", store, "--yes", *idle)
    assert names() == ["new", "month"]
    done = sessions("list", "--store", store, "--active-before", "2025-01-01T00:00:00")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "--active-before" in done.stderr
    assert "offset" in done.stderr
    assert "'2025-01-01T00:00:00'" in done.stderr  # (a time is no secret: shown as given)


def test_show_prints_state_messages_and_events(tmp_path: Path) -> None:
    """show prints the status, metadata, summary, pending reviews and messages; --json
    gives messages (with role and content) and metadata; --events adds the journal."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    with serving(f"sqlite:{path}") as server:
        populate(server)
        body = json.loads(ok("show", "a", "--store", store, "--json", "--events"))
        assert [(m["role"], m["content"]) for m in body["messages"]] == [
            ("user", "hello from a"),
            ("assistant", "hello from a"),
        ]
        assert body["metadata"] == {"tenant": "acme"}
        assert body["system_prompt"] is None
        assert "TurnFinished" in [e["type"] for e in body["events"]]
        text = ok("show", "a", "--store", store)
        for part in ("session a", '"tenant": "acme"', "summary:", "pending reviews: 0"):
            assert part in text
        assert "[assistant] hello from a" in text
        assert "'nobody'" in refused("show", "nobody", "--store", store)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
async def test_commands_print_any_text_to_an_output_that_cannot_encode_it(
    tmp_path: Path, encoding: str
) -> None:
    """list, show, export and tail print a session whose name, metadata and messages hold
    characters that standard output's encoding cannot write (PYTHONIOENCODING=ascii, a
    Latin-1 locale) as JSON escapes (\\u00e9), instead of failing: all they print is
    ASCII, their JSON reads back as the same values as a UTF-8 output's, and the export
    imports into another store."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    name = "café ☕"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        ref = await registry.spawn(name, metadata={"who": "zoë 🙂"})
        await ref.send("héllo wörld ✓ 😀")
    env = {key: value for key, value in os.environ.items() if key != "SESSIONACTORS_STORE"}
    env["PYTHONIOENCODING"] = encoding

    def narrow(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "sessionactors", "sessions", *args],
            capture_output=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert (done.returncode, done.stderr) == (0, b""), done.stderr
        return done.stdout.decode("ascii")

    commands = [
        ["list", "--store", store, "--json"],
        ["show", name, "--store", store, "--json", "--events"],
        ["export", name, "--store", store],
        ["tail", name, "--store", store, "--after", "0", "--no-follow"],
    ]
    for args in commands:
        wide = await trio.to_thread.run_sync(ok, *args)
        told = await trio.to_thread.run_sync(narrow, *args)
        assert "\\u" in told, told
        if args[0] == "tail":  # (a JSON line an event)
            assert [json.loads(line) for line in told.splitlines()] == [
                json.loads(line) for line in wide.splitlines()
            ]
        elif args[0] == "export":  # (the time of the export differs)
            assert json.loads(told)["session"] == json.loads(wide)["session"]
        else:
            assert json.loads(told) == json.loads(wide), args
    for args in (["list", "--store", store], ["show", name, "--store", store]):
        told = await trio.to_thread.run_sync(narrow, *args)
        assert "caf\\u00e9 \\u2615" in told, told
    exported = tmp_path / "exported.json"
    exported.write_text(await trio.to_thread.run_sync(narrow, "export", name, "--store", store))
    other = f"sqlite:///{tmp_path / 'other.db'}"
    await trio.to_thread.run_sync(ok, "import", str(exported), "--store", other)
    shown = json.loads(await trio.to_thread.run_sync(ok, "show", name, "--store", other, "--json"))
    assert shown["metadata"] == {"who": "zoë 🙂"}


async def test_list_tells_of_a_session_whose_listing_entry_is_unreadable(tmp_path: Path) -> None:
    """list shows a session whose stored info was damaged, its history intact, as its
    history says, and says so on stderr (not as failed, silently: an operator cleaning
    up failed sessions would delete an intact conversation); one whose history is
    damaged too is listed as failed, with the command that deletes it."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        for name in ("kept", "gone"):
            await (await registry.spawn(name)).send("hi")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE sessions SET info = x'00'")
        db.execute("UPDATE snapshots SET data = x'00' WHERE session_id = 'gone'")
    db.close()
    done = await trio.to_thread.run_sync(sessions, "list", "--store", store)
    assert done.returncode == 0, done.stderr
    listed = sorted(line.split("\t")[:3] for line in done.stdout.splitlines())
    assert listed == [["gone", "failed", "0 messages"], ["kept", "hibernated", "2 messages"]]
    told = done.stderr.splitlines()
    assert len(told) == 2, told
    [kept] = [line for line in told if "'kept'" in line]
    assert "as its history says" in kept, kept
    assert "delete" not in kept, kept
    [gone] = [line for line in told if "'gone'" in line]
    assert "sessions delete --store URL --yes gone" in gone, gone


async def test_show_json_carries_the_turn_that_waits_on_a_review(tmp_path: Path) -> None:
    """show --json of a session stored while a turn waits on a review carries that turn
    as ``open_turn`` (its id, status waiting, the user message it answers, its key), as
    the gateway's state does; null once the turn is over."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"

    async def refund(order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        return f"refunded {order_id}"

    tool = sa.Tool(name="refund", fn=refund, requires_review=True, idempotent=False)
    asked = sa.ToolCall(id="c1", name="refund", arguments='{"order_id": "A1"}')
    model = ScriptedModel([Scripted(text="I will refund it.", tool_calls=[asked]), "done"])
    agents = {"a": sa.Agent(model=model, tools=[tool])}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s")
            waiting = await ref.send("Refund A1", idempotency_key="k1")
            [review] = waiting.reviews
            await ref.hibernate()
            body = json.loads(
                await trio.to_thread.run_sync(ok, "show", "s", "--store", store, "--json")
            )
            await ref.review(review.id, approve=True)
            await ref.hibernate()
            after = json.loads(
                await trio.to_thread.run_sync(ok, "show", "s", "--store", store, "--json")
            )
    [user] = [m for m in body["messages"] if m["role"] == "user"]
    turn = body["open_turn"]
    assert (turn["turn_id"], turn["status"]) == (waiting.turn_id, "waiting"), turn
    assert (turn["message_id"], turn["idempotency_key"]) == (user["id"], "k1"), turn
    assert turn["started_at"] is not None, turn
    assert [r["id"] for r in body["pending_reviews"]] == [review.id]
    assert after["open_turn"] is None, after


async def test_show_says_how_the_turn_of_an_interrupted_reply_ended(tmp_path: Path) -> None:
    """show marks a reply that its turn's failure or cancel cut off with the turn's id, its outcome and, for a failure, the error's kind (not its words, which may name secrets)."""
    path = tmp_path / "s.db"
    gate = trio.Event()
    model = ScriptedModel(
        [
            Scripted(chunks=["half ", "a reply"], error=sa.ModelError("key sk-SECRET refused")),
            Scripted(error=RuntimeError("boom")),
            Scripted(chunks=["never", " finished"], wait=gate, wait_after=1),
            "fine",
        ]
    )
    async with sa.open_registry(
        store=sa.SQLiteStore(path), agents={"scripted": sa.Agent(model=model)}
    ) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn("s")
            with pytest.raises(sa.TurnFailedError):
                await ref.send("first")
            with pytest.raises(sa.TurnFailedError):
                await ref.send("second")
            async with ref.subscribe() as events:
                turn = await ref.submit("third")
                async for event in events:
                    if isinstance(event, sa.Delta):
                        break
            await ref.cancel()
            with pytest.raises(sa.TurnCancelledError):
                await turn.reply()
            assert (await ref.send("fourth")).text == "fine"
            turns = (await ref.state()).turns
    failed, failed_again, cancelled, _ = (t.turn_id for t in turns)
    text = await trio.to_thread.run_sync(ok, "show", "s", "--store", f"sqlite:///{path}")
    lines = [line.strip() for line in text.splitlines()]
    assert f"[assistant] half a reply (interrupted: turn {failed} failed: ModelError)" in lines
    assert (
        f"[assistant] (no reply: this turn failed) (interrupted: turn {failed_again} failed: "
        "RuntimeError)"
    ) in lines
    assert f"[assistant] never (interrupted: turn {cancelled} was cancelled)" in lines
    assert "[assistant] fine" in lines
    assert "SECRET" not in text
    assert "boom" not in text


# ---- export and import -------------------------------------------------------------


@attrs.define
class RecordingModel:
    """Echoes, and keeps every request it was sent."""

    requests: list[sa.ModelRequest] = attrs.Factory(list)

    def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        self.requests.append(request)
        return EchoModel().stream(request)


def test_an_exported_session_imports_and_takes_turns_with_its_whole_history(
    tmp_path: Path,
) -> None:
    """export writes a versioned JSON document; import (from a file or stdin, under its
    name or another) stores it whole, and the imported session takes a turn with its
    whole history in front of the model; importing over a stored name is refused."""
    source = tmp_path / "source.db"
    target = tmp_path / "target.db"
    with serving(f"sqlite:{source}") as server:
        populate(server)
        assert server.ask("send a second words") == "second words"
        exported = ok("export", "a", "--store", f"sqlite:///{source}")
    document = json.loads(exported)
    assert document["format"] == "sessionactors.session"
    assert document["version"] == 1
    assert document["session"]["session_id"] == "a"
    assert document["session"]["agent"] == "echo"
    assert document["session"]["metadata"] == {"tenant": "acme"}
    assert len(document["session"]["messages"]) == 4
    file = tmp_path / "a.json"
    file.write_text(exported)
    store = f"sqlite:///{target}"
    done = sessions("import", str(file), "--store", store)  # into a new file: said
    assert done.returncode == 0, done.stderr
    assert "imported session 'a'" in done.stdout
    assert f"created a new store at {str(target)!r}" in done.stderr, done.stderr
    assert "'b2'" in ok("import", "-", "--as", "b2", "--store", store, stdin=exported)
    line = refused("import", str(file), "--store", store)
    assert "already exists" in line
    assert "--as" in line

    model = RecordingModel()

    async def turn() -> tuple[list[str], list[str]]:
        agents = {"echo": sa.Agent(model=model)}
        async with sa.open_registry(store=sa.SQLiteStore(target), agents=agents) as registry:
            names = [info.session_id for info in await registry.sessions()]
            reply = await registry.ref("b2").send("third time")
            assert reply.text == "third time"
            return names, [m.content for m in await registry.ref("b2").history()]

    names, history = trio.run(turn)
    assert sorted(names) == ["a", "b2"]
    seen = [(m.role.value, m.content) for m in model.requests[0].messages]
    assert seen == [
        ("user", "hello from a"),
        ("assistant", "hello from a"),
        ("user", "second words"),
        ("assistant", "second words"),
        ("user", "third time"),
    ]
    assert history[-1] == "third time"


def test_import_under_another_name_refuses_a_session_waiting_on_a_review(
    tmp_path: Path,
) -> None:
    """import --as of a session whose turn waits on a review is refused, naming the session
    and what to do (a copy would run the call a second time), and writes nothing; import
    under its own name moves it: its review is pending there and its call runs once."""
    source = tmp_path / "source.db"
    target = tmp_path / "target.db"
    refunded: list[str] = []

    async def refund(order_id: str) -> str:
        await trio.lowlevel.checkpoint()
        refunded.append(order_id)
        return "refunded"

    tool = sa.Tool(
        name="refund", fn=refund, description="Refund.", requires_review=True, idempotent=False
    )
    call = sa.ToolCall(id="c1", name="refund", arguments='{"order_id": "A1"}')

    def agents() -> dict[str, sa.Agent]:
        model = ScriptedModel([Scripted(tool_calls=[call]), "done"])
        return {"a": sa.Agent(model=model, tools=[tool])}

    async def waiting() -> None:
        async with sa.open_registry(store=sa.SQLiteStore(source), agents=agents()) as registry:
            reply = await (await registry.spawn("cust")).send("refund A1")
            assert reply.reviews

    trio.run(waiting)
    exported = ok("export", "cust", "--store", f"sqlite:///{source}")
    store = f"sqlite:///{target}"
    line = refused("import", "-", "--as", "cust-copy", "--store", store, stdin=exported)
    assert "session 'cust'" in line
    assert "review" in line
    assert "under its own name" in line
    assert not target.exists() or ok("list", "--store", store) == ""
    assert "imported session 'cust'" in ok("import", "-", "--store", store, stdin=exported)

    async def approve() -> list[tuple[str, str]]:
        async with sa.open_registry(store=sa.SQLiteStore(target), agents=agents()) as registry:
            pending = await registry.pending_reviews()
            for review in pending:
                await registry.ref(review.session_id).review(review.id, approve=True)
            return [(review.session_id, review.tool_call.id) for review in pending]

    assert trio.run(approve) == [("cust", "c1")]
    assert refunded == ["A1"]


def test_import_refuses_what_is_not_a_faithful_export(tmp_path: Path) -> None:
    """import refuses, in one line and before writing anything, a file that is not JSON,
    not an export, a newer version, or an export whose readable part was edited."""
    path = tmp_path / "s.db"
    with serving(f"sqlite:{path}") as server:
        populate(server)
        document = json.loads(ok("export", "a", "--store", f"sqlite:///{path}"))
    target = f"sqlite:///{tmp_path / 'target.db'}"
    edited = json.loads(json.dumps(document))
    edited["session"]["messages"][0]["content"] = "changed"
    newer = dict(document, version=2)
    cases = {
        "not json": "is not JSON",
        json.dumps({"format": "other"}): "not a sessionactors session export",
        json.dumps(newer): "newer",
        json.dumps(edited): "differs from its",
    }
    for text, expected in cases.items():
        assert expected in refused("import", "-", "--store", target, stdin=text)
    assert not (tmp_path / "target.db").exists() or ok("list", "--store", target) == ""


def test_import_restores_a_session_stored_before_the_input_limits(tmp_path: Path) -> None:
    """import restores what a store may hold, as loading it does: an export of a session
    stored before the input limits, whose metadata is over MAX_METADATA_BYTES and whose
    system prompt is over the text limit, imports whole, is listed and takes a turn."""
    now = datetime.datetime.now(datetime.UTC)
    target = tmp_path / "target.db"
    metadata = {"blob": "x" * 100_000}
    state = sa.SessionState(
        session_id="big",
        agent="echo",
        created_at=now,
        updated_at=now,
        metadata=metadata,
        system_prompt="p" * 1_500_000,
    )
    document = json.dumps(export_document(state))
    store = f"sqlite:///{target}"
    assert "imported session 'big'" in ok("import", "-", "--store", store, stdin=document)
    assert "big" in ok("list", "--store", store)

    async def turn() -> sa.SessionState:
        agents = {"echo": sa.Agent(model=EchoModel())}
        async with sa.open_registry(store=sa.SQLiteStore(target), agents=agents) as registry:
            assert (await registry.ref("big").send("hi")).text == "hi"
            return await registry.ref("big").state()

    imported = trio.run(turn)
    assert imported.metadata == metadata
    assert imported.system_prompt == state.system_prompt


def test_the_cli_advises_its_own_delete_for_a_corrupt_session(tmp_path: Path) -> None:
    """`sessions show` of a session whose stored snapshot is corrupt advises the command
    line's own `sessions delete --store URL --yes NAME` on the same store, not the
    Python registry.delete(...)."""
    path = tmp_path / "store.db"

    async def make() -> None:
        async with sa.open_registry(
            store=sa.SQLiteStore(str(path)), agents={"a": sa.Agent(model=EchoModel())}
        ) as registry:
            await (await registry.spawn("c3")).send("hi")

    trio.run(make)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE snapshots SET data = ? WHERE session_id = 'c3'", (b"\xc1junk",))
    line = refused("show", "c3", "--store", f"sqlite:///{path}")
    assert "corrupt" in line, line
    assert "registry.delete" not in line, line
    advice = f"`python -m sessionactors sessions delete --store sqlite:///{path} --yes c3`"
    assert advice in line, line


# ---- writing beside a server ------------------------------------------------------


def test_write_commands_honour_the_lease_of_a_server_sharing_the_file(tmp_path: Path) -> None:
    """delete refuses, in one line, a session live in a server that shares the file (it
    holds the session's lease), and deletes it once the server hibernated it; import
    works beside that server."""
    path = tmp_path / "shared.db"
    store = f"sqlite:///{path}"
    with serving(f"sqlite-shared:{path}") as server:
        populate(server)
        line = refused("delete", "a", "--yes", "--store", store)
        assert "'a' is live in another process" in line
        assert "DELETE /sessions/a" in line, line  # (what an operator can do, not Python)
        assert "registry.delete" not in line, line
        assert server.ask("hibernate a") == "ok"
        assert "deleted session 'a'" in ok("delete", "a", "--yes", "--store", store)
        assert [r["name"] for r in json.loads(ok("list", "--json", "--store", store))] == [
            "c",
            "b",
        ]
        exported = ok("export", "b", "--store", store)
        ok("import", "-", "--as", "b-copy", "--store", store, stdin=exported)
        assert server.ask("send b-copy and on") == "and on"  # the server takes it up
    assert "'a'" in refused("delete", "a", "--yes", "--store", store)  # gone


def test_write_commands_beside_an_exclusive_server_say_to_share_the_file(
    tmp_path: Path,
) -> None:
    """A server holding its file exclusively (the default) refuses a write command,
    which says so in one line and names the fix (shared=True, ?shared=true)."""
    path = tmp_path / "s.db"
    with serving(f"sqlite:{path}") as server:
        populate(server)
        before = digests(path)
        line = refused("delete", "a", "--yes", "--store", f"sqlite:///{path}")
        assert "in use by process" in line
        assert "shared=True" in line
        assert "?shared=true" in line
        assert digests(path) == before


def test_delete_takes_several_names_and_says_which_it_did_not_find(tmp_path: Path) -> None:
    """delete takes several names: it deletes each that is stored (a line each on
    stdout), says of each that is not that it is not stored (a line each on stderr), and
    exits with status 1 if any was not; without --yes it deletes none of them."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    with serving(f"sqlite:{path}") as server:
        populate(server)
    line = refused("delete", "a", "c", "--store", store)
    assert "sessions 'a' and 'c'" in line
    assert "--yes" in line
    done = sessions("delete", "a", "nobody", "c", "ghost", "--yes", "--store", store)
    assert (done.returncode, done.stdout) == (1, "deleted session 'a'\ndeleted session 'c'\n")
    assert done.stderr.splitlines() == [
        "sessionactors sessions delete: session 'nobody' is not stored",
        "sessionactors sessions delete: session 'ghost' is not stored",
    ]
    assert [r["name"] for r in json.loads(ok("list", "--json", "--store", store))] == ["b"]
    assert ok("delete", "b", "--yes", "--store", store) == "deleted session 'b'\n"


def test_delete_needs_yes(tmp_path: Path) -> None:
    """delete without --yes deletes nothing and says how to confirm, in one line."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    with serving(f"sqlite:{path}") as server:
        populate(server)
    assert "--yes" in refused("delete", "a", "--store", store)
    assert [r["name"] for r in json.loads(ok("list", "--json", "--store", store))] == [
        "c",
        "b",
        "a",
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["list", "--store", "ftp://x"], "not a store URL"),
        (["list", "--store", "sqlite://relative.db"], "sqlite:///relative.db"),
        (["list", "--store", "sqlite:///{tmp}/none.db"], "does not exist"),
        (["list", "--store", "sqlite:///{tmp}/s.db?mode=rw"], "?shared=true"),
        (["show", "x", "--store", "sqlite:///{tmp}/not-a-store.db"], "not a sessionactors store"),
        (["list", "--limit", "0", "--store", "sqlite:///{tmp}/s.db"], "--limit"),
        (["list", "--meta", "novalue", "--store", "sqlite:///{tmp}/s.db"], "KEY=VALUE"),
        (["list", "--active-before", "soon", "--store", "sqlite:///{tmp}/s.db"], "duration"),
        (["list", "--active-before", "12x", "--store", "sqlite:///{tmp}/s.db"], "ISO 8601"),
        (["show", "\x01", "--store", "sqlite:///{tmp}/s.db"], "control"),
        (["import", "{tmp}/missing.json", "--store", "sqlite:///{tmp}/s.db"], "missing.json"),
        (["import", "{tmp}/nested.json", "--store", "sqlite:///{tmp}/s.db"], "not JSON"),
        (["import", "{tmp}/latin1.json", "--store", "sqlite:///{tmp}/s.db"], "latin1.json"),
        (["tail", "nobody", "--after", "0", "--store", "sqlite:///{tmp}/s.db"], "nobody"),
        (["list"], "--store"),
    ],
)
def test_errors_are_one_line_without_a_traceback(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    """A bad URL, a missing file, a bad argument or a bad name fails with one line on
    stderr and a non-zero exit status."""
    (tmp_path / "not-a-store.db").write_bytes(b"not sqlite at all" * 100)
    (tmp_path / "nested.json").write_text("[" * 100_000)
    (tmp_path / "latin1.json").write_bytes(b'{"format": "caf\xe9"}')
    if any("s.db" in a for a in args):
        trio.run(_store_with_one_session, tmp_path / "s.db")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = refused(*args)
    assert expected in line, line


def test_import_of_a_path_that_is_no_readable_file_names_it_and_what_to_pass(
    tmp_path: Path,
) -> None:
    """import of a directory, a missing file or a path through a file says in one line
    (status 1, no OS error number) which path it could not read, why, and to pass an
    export file or - for standard input; it creates no store."""
    (tmp_path / "file").write_text("{}")
    target = tmp_path / "target.db"
    cases = {
        tmp_path: "is a directory",
        tmp_path / "missing.json": "does not exist",
        tmp_path / "file" / "x.json": "not a directory",
    }
    for path, why in cases.items():
        done = sessions("import", str(path), "--store", f"sqlite:///{target}")
        assert done.returncode == 1, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        line = done.stderr
        assert f"cannot read {str(path)!r}" in line, line
        assert why in line, line
        assert "written by export" in line, line
        assert "- for standard input" in line, line
        assert "Errno" not in line, line
    assert not target.exists()


async def _store_with_one_session(path: Path) -> None:
    agent = sa.Agent(model=EchoModel())
    async with sa.open_registry(store=sa.SQLiteStore(path), agents={"echo": agent}) as registry:
        await (await registry.spawn("a")).send("hello from a")


@pytest.mark.parametrize("file", ["s.db", "u:x@y.db"])  # (no password in a sqlite path)
def test_a_session_name_that_is_not_utf8_is_listed_on_stderr_and_deleted_as_shown(
    tmp_path: Path, file: str
) -> None:
    """A stored session whose name is not valid UTF-8 (damage in the file) fails neither
    list nor the others: list names it on stderr, shell-quoted, with the delete command
    that removes it (the store's path as given, whatever it holds), and delete takes it
    as shown (the shell passes its bytes)."""
    path = tmp_path / file
    store = f"sqlite:///{path}"
    with serving(f"sqlite:{path}") as server:
        populate(server)
    with contextlib.closing(sqlite3.connect(path)) as conn:  # bit rot in one name
        for table in ("sessions", "snapshots", "journal", "leases"):
            conn.execute(
                f"UPDATE {table} SET session_id = CAST(? AS TEXT) WHERE session_id = 'b'",
                (b"\xff19",),
            )
        conn.commit()
    done = sessions("list", "--json", "--store", store)
    assert done.returncode == 0, done.stderr
    assert [r["name"] for r in json.loads(done.stdout)] == ["c", "a"]
    assert done.stderr.count("\n") == 1, done.stderr
    assert "$'\\xff19'" in done.stderr, done.stderr
    assert f"sessions delete --store {store} --yes $'\\xff19'`\n" in done.stderr, done.stderr
    # the shell's $'\xff19' is the argument's bytes, which Python reads as this str
    assert ok("delete", "--yes", "--store", store, "\udcff19") == "deleted session $'\\xff19'\n"
    assert [r["name"] for r in json.loads(ok("list", "--json", "--store", store))] == ["c", "a"]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for table in ("sessions", "snapshots", "journal"):
            left = conn.execute(f"SELECT count(*) FROM {table} WHERE session_id > 'c'").fetchone()
            assert left == (0,), table
    assert "not in this store" in refused("delete", "--yes", "--store", store, "\udcff19")


@pytest.mark.redis
async def test_a_redis_session_name_that_is_not_utf8_is_listed_on_stderr_and_deleted_as_shown(
    redis_url: str,
) -> None:
    """On Redis as on SQLite, a stored session whose name is not valid UTF-8 (damage to
    its keys) fails neither list nor the others: list names it on stderr, shell-quoted,
    with the delete command that removes it, and delete takes it as shown and removes
    every key of it."""
    prefix = f"sa-test-cli-{uuid.uuid4().hex[:12]}"
    store = f"{redis_url}?prefix={prefix}"
    agents = {"echo": sa.Agent(model=EchoModel())}
    try:
        async with sa.open_registry(
            store=RedisStore(redis_url, prefix=prefix), agents=agents
        ) as registry:
            for name in ("a", "b", "c"):
                await (await registry.spawn(name)).send(f"hello from {name}")
        await rot_name(redis_url, prefix, "b", b"\xff19")
        done = await trio.to_thread.run_sync(sessions, "list", "--json", "--store", store)
        assert done.returncode == 0, done.stderr
        assert [r["name"] for r in json.loads(done.stdout)] == ["c", "a"]
        assert done.stderr.count("\n") == 1, done.stderr
        command = f"sessions delete --store '{store}' --yes $'\\xff19'"
        assert command in done.stderr, done.stderr
        # the shell's $'\xff19' is the argument's bytes, which Python reads as this str
        deleted = await trio.to_thread.run_sync(ok, "delete", "--yes", "--store", store, "\udcff19")
        assert deleted == "deleted session $'\\xff19'\n"
        assert await keys_of(redis_url, prefix, b"\xff19") == []
        listed = await trio.to_thread.run_sync(ok, "list", "--json", "--store", store)
        assert [r["name"] for r in json.loads(listed)] == ["c", "a"]
        again = await trio.to_thread.run_sync(
            refused, "delete", "--yes", "--store", store, "\udcff19"
        )
        assert "not in this store" in again, again
    finally:
        await drop_prefix(redis_url, prefix)


@pytest.mark.redis
async def test_the_commands_list_prints_never_hold_the_password_of_the_store_url(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """list's hints name the store's URL with *** in place of its password, wherever
    the URL holds one: the delete command it prints for a damaged name says to put the
    password back in place of ***, and that command with the password removes the
    session; the note on a store that holds no sessions names the URL so too."""
    secret = "hunter2-Zq9"
    with private_redis_server(config=("--requirepass", secret)) as plain:
        host = plain.removeprefix("redis://").removesuffix("/0")
        prefix = f"sa-test-cli-{uuid.uuid4().hex[:12]}"
        for url, shown in [
            (f"redis://:{secret}@{host}/0", f"redis://:***@{host}/0"),
            (f"redis://default:{secret}@{host}/0", f"redis://default:***@{host}/0"),
            (f"redis://{host}/0?password={secret}", f"redis://{host}/0?password=***"),
        ]:
            agents = {"echo": sa.Agent(model=EchoModel())}
            store = RedisStore(url, prefix=prefix)
            async with sa.open_registry(store=store, agents=agents) as registry:
                await (await registry.spawn("b")).send("hello")
            await rot_name(f"redis://:{secret}@{host}/0", prefix, "b", b"\xff19")
            given = f"{url}{'&' if '?' in url else '?'}prefix={prefix}"
            done = await trio.to_thread.run_sync(sessions, "list", "--store", given)
            assert done.returncode == 0, done.stderr
            assert secret not in done.stderr, done.stderr
            hint = f"sessions delete --store '{shown}{'&' if '?' in shown else '?'}prefix={prefix}'"
            assert hint in done.stderr, done.stderr
            assert "put the password back in place of ***" in done.stderr, done.stderr
            deleted = await trio.to_thread.run_sync(
                ok, "delete", "--yes", "--store", given, "\udcff19"
            )
            assert deleted == "deleted session $'\\xff19'\n"
            other = f"{url}{'&' if '?' in url else '?'}prefix={prefix}-typo"
            empty = await trio.to_thread.run_sync(sessions, "list", "--store", other)
            assert empty.returncode == 0, empty.stderr
            assert "holds no sessions" in empty.stderr, empty.stderr
            assert secret not in empty.stderr, empty.stderr
            assert shown in empty.stderr, empty.stderr


@pytest.mark.redis
@pytest.mark.parametrize("how", ["env", "file"])
async def test_the_commands_read_the_store_url_from_the_environment_or_a_file(
    private_redis_server: Callable[..., AbstractContextManager[str]], tmp_path: Path, how: str
) -> None:
    """The commands take the store's URL from SESSIONACTORS_STORE or --store-file as from
    --store, so that a Redis password stays off the command line: they reach a
    redis-server that requires it, never print the password, and the delete command that
    list prints for a damaged name gives the store as it was given (no --store, or the
    same --store-file) and works as printed."""
    secret = "hunter2-Zq9"
    with private_redis_server(config=("--requirepass", secret)) as plain:
        host = plain.removeprefix("redis://").removesuffix("/0")
        prefix = f"sa-test-cli-{uuid.uuid4().hex[:12]}"
        url = f"redis://:{secret}@{host}/0"
        agents = {"echo": sa.Agent(model=EchoModel())}
        store = RedisStore(url, prefix=prefix)
        async with sa.open_registry(store=store, agents=agents) as registry:
            for name in ("a", "b"):
                await (await registry.spawn(name)).send(f"hello from {name}")
        await rot_name(url, prefix, "b", b"\xff19")
        given: list[str] = []
        env = {"SESSIONACTORS_STORE": f"{url}?prefix={prefix}"}
        if how == "file":
            (tmp_path / "store").write_text(f"{url}?prefix={prefix}\n")
            given, env = ["--store-file", str(tmp_path / "store")], {}
        listed = functools.partial(sessions, "list", "--json", *given, env=env)
        done = await trio.to_thread.run_sync(listed)
        assert done.returncode == 0, done.stderr
        assert [r["name"] for r in json.loads(done.stdout)] == ["a"]
        assert secret not in done.stderr, done.stderr
        printed = " ".join(["sessions delete", *map(shlex.quote, given), "--yes $'\\xff19'`"])
        assert printed in done.stderr, done.stderr
        assert "***" not in done.stderr, done.stderr
        shown = await trio.to_thread.run_sync(functools.partial(ok, "show", "a", *given, env=env))
        assert "hello from a" in shown, shown
        delete = functools.partial(ok, "delete", "--yes", *given, "\udcff19", env=env)
        assert await trio.to_thread.run_sync(delete) == "deleted session $'\\xff19'\n"
        assert await keys_of(url, prefix, b"\xff19") == []


async def test_every_command_takes_store_file_and_an_explicit_store_wins_over_the_environment(
    tmp_path: Path,
) -> None:
    """Every command takes --store-file PATH (the URL in the file, its surrounding
    whitespace dropped) where it takes --store URL; without either, SESSIONACTORS_STORE;
    with either, that variable is not used."""
    path = tmp_path / "s.db"
    await _store_with_one_session(path)
    good = f"sqlite:///{path}"
    (tmp_path / "store").write_text(f"  {good}\n\n")
    from_file = ["--store-file", str(tmp_path / "store")]
    other = {"SESSIONACTORS_STORE": f"sqlite:///{tmp_path / 'other.db'}"}

    async def sync(check: Callable[..., str], *args: str, env: dict[str, str] = other) -> str:
        return await trio.to_thread.run_sync(functools.partial(check, *args, env=env))

    assert (await sync(ok, "list", *from_file)).startswith("a\t")
    assert (await sync(ok, "list", "--store", good)).startswith("a\t")
    assert (await sync(ok, "list", env={"SESSIONACTORS_STORE": good})).startswith("a\t")
    assert "other.db' does not exist" in await sync(refused, "list")
    assert "hello from a" in await sync(ok, "show", "a", *from_file)
    exported = await sync(ok, "export", "a", *from_file)
    (tmp_path / "a.json").write_text(exported)
    imported = await sync(ok, "import", str(tmp_path / "a.json"), "--as", "b", *from_file)
    assert imported == "imported session 'b' (2 messages)\n"
    tailed = await sync(ok, "tail", "a", "--no-follow", *from_file)
    assert tailed
    assert {json.loads(line)["session_id"] for line in tailed.splitlines()} == {"a"}
    assert await sync(ok, "delete", "b", "--yes", *from_file) == "deleted session 'b'\n"
    listed = await sync(ok, "list", *from_file)
    assert [line.split("\t")[0] for line in listed.splitlines()] == ["a"]


@pytest.mark.parametrize("how", ["--store", "--store-file", "SESSIONACTORS_STORE"])
async def test_the_hints_about_the_store_name_it_as_it_was_given(tmp_path: Path, how: str) -> None:
    """Every hint that says to check the store, or prints a command to run on it, names
    the store as it was given: --store, the same --store-file, or SESSIONACTORS_STORE
    (whose commands printed name no store: they run in the same environment), never
    --store for a store given otherwise."""
    files = itertools.count()

    def given(path: Path) -> tuple[list[str], dict[str, str], str, str]:
        """The arguments and environment that give the SQLite store at ``path``, where a
        hint says it came from, and the store's words in a command printed to run."""
        url = f"sqlite:///{path}"
        if how == "--store":
            return ["--store", url], {}, "--store", f" --store {shlex.quote(url)}"
        if how == "--store-file":
            file = tmp_path / f"store-{next(files)}"
            file.write_text(f"{url}\n")
            words = f" --store-file {shlex.quote(str(file))}"
            return ["--store-file", str(file)], {}, f"--store-file {str(file)!r}", words
        return [], {"SESSIONACTORS_STORE": url}, "SESSIONACTORS_STORE", ""

    async def sync(check: Callable[..., Any], *args: str, env: dict[str, str]) -> Any:
        return await trio.to_thread.run_sync(functools.partial(check, *args, env=env))

    args, env, where, _ = given(tmp_path / "nope.db")  # a mistyped path
    line = await sync(refused, "list", *args, env=env)
    assert f"nope.db' does not exist; check the path in {where}" in line, line
    path = tmp_path / "s.db"
    await _store_with_one_session(path)
    args, env, where, words = given(path)
    for command in (["show", "nobody"], ["tail", "nobody"]):
        line = await sync(refused, *command, *args, env=env)
        listing = f"`python -m sessionactors sessions list{words}` lists the stored sessions"
        assert listing in line, line
    (tmp_path / "a.json").write_text(await sync(ok, "export", "a", *args, env=env))
    new_args, new_env, new_where, _ = given(tmp_path / "new.db")
    imported = await sync(sessions, "import", str(tmp_path / "a.json"), *new_args, env=new_env)
    assert imported.returncode == 0, imported.stderr
    assert f"check the path in {new_where}" in imported.stderr, imported.stderr
    await sync(ok, "delete", "--yes", "a", *new_args, env=new_env)
    empty_args, empty_env, empty_where, _ = given(tmp_path / "new.db")  # (now empty)
    listed = await sync(sessions, "list", *empty_args, env=empty_env)
    assert listed.returncode == 0, listed.stderr
    assert f"check that {empty_where} names the file" in listed.stderr, listed.stderr
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE snapshots SET data = ? WHERE session_id = 'a'", (b"\xc1junk",))
        conn.commit()
    line = await sync(refused, "show", "a", *args, env=env)
    assert f"`python -m sessionactors sessions delete{words} --yes a`" in line, line
    later_args, later_env, later_where, _ = given(tmp_path / "later.db")  # not made yet
    inherited = {key: value for key, value in os.environ.items() if key != "SESSIONACTORS_STORE"}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "sessionactors", "sessions", "tail", "x", "--wait", *later_args],
        stderr=subprocess.PIPE,
        env={**inherited, **later_env},
    )
    assert process.stderr is not None
    try:
        with trio.fail_after(60):
            note = await _Lines(process.stderr).next()
        assert f"(check the path in {later_where} if no server" in note, note
    finally:
        await reap(process)


#: A password that a refused store URL or store file holds, which no refusal may print.
STORE_SECRET = "hunter2-Zq9"


@pytest.mark.parametrize(
    ("args", "content", "variable", "said", "status"),
    [
        (["--store-file", "{dir}/missing"], None, None, "--store-file '{dir}/missing'", 2),
        (["--store-file", "{dir}"], None, None, "--store-file '{dir}'", 2),
        (["--store-file", "{dir}/store"], "\n \n", None, "--store-file '{dir}/store' is empty", 2),
        (
            ["--store-file", "{dir}/store"],
            f"redis://:{STORE_SECRET}@h:6379/0\nredis://:{STORE_SECRET}@h:6379/1\n",
            None,
            "--store-file '{dir}/store' holds more than one line",
            2,
        ),
        (
            ["--store-file", "{dir}/store"],
            f"redis//:{STORE_SECRET}@h:6379/0\n",
            None,
            "--store-file '{dir}/store' holds 'redis//:***@h:6379/0'",
            2,
        ),
        (["--store", "sqlite:///x.db", "--store-file", "{dir}/store"], "x", None, "not both", 2),
        ([], None, "", "SESSIONACTORS_STORE is set but empty", 2),
        ([], None, f"redis//:{STORE_SECRET}@h:6379/0", "SESSIONACTORS_STORE 'redis//:***@h", 2),
        ([], None, None, "--store", 2),
    ],
    ids=[
        "missing",
        "directory",
        "empty",
        "two-lines",
        "not-a-url",
        "both",
        "empty-variable",
        "bad-variable",
        "none",
    ],
)
def test_the_commands_refuse_a_store_file_or_variable_they_cannot_use(
    tmp_path: Path,
    args: list[str],
    content: str | None,
    variable: str | None,
    said: str,
    status: int,
) -> None:
    """A store file that is missing, no file, empty or of more than one line, one given
    with --store, a SESSIONACTORS_STORE set but empty, no store given at all, or a URL in
    either that names no store (as a --store that names none), is refused with status 2
    in one line that names the file or the variable and never prints a password."""
    if content is not None:
        (tmp_path / "store").write_text(content)
    env = None if variable is None else {"SESSIONACTORS_STORE": variable}
    done = sessions("list", *[arg.format(dir=tmp_path) for arg in args], env=env)
    assert done.returncode == status, done.stderr
    assert done.stderr.startswith("sessionactors sessions list: "), done.stderr
    assert said.format(dir=tmp_path) in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert STORE_SECRET not in done.stderr + done.stdout, done.stderr


# ---- tail ---------------------------------------------------------------------------


async def test_tail_no_follow_without_after_prints_every_stored_event(tmp_path: Path) -> None:
    """tail --no-follow without --after prints the events the store holds (as --after 0),
    rather than nothing: "from now on" and "stop now" together would print nothing."""
    path = tmp_path / "s.db"
    await _store_with_one_session(path)
    store = f"sqlite:///{path}"
    everything = ok("tail", "a", "--store", store, "--after", "0", "--no-follow")
    assert "TurnFinished" in everything
    assert ok("tail", "a", "--store", store, "--no-follow") == everything


async def test_tail_ends_with_one_line_when_the_session_is_deleted(tmp_path: Path) -> None:
    """tail, started while no process has the file open, prints what a later process
    stores, and ends (status 1, one line naming the session) once the session is
    deleted, rather than following it forever."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    await _store_with_one_session(path)
    # (from the stored seq on, not "from now on": tail may read the session after the
    # later process stored its turn)
    stored = sa.SQLiteStore(path)
    try:
        after = (await sa.read_session(stored, "a")).event_seq
    finally:
        await stored.aclose()
    process = await _open_tail("a", "--store", store, "--after", str(after))
    try:
        with trio.fail_after(60):
            agent = sa.Agent(model=EchoModel())
            async with sa.open_registry(
                store=sa.SQLiteStore(path), agents={"echo": agent}
            ) as registry:
                await registry.ref("a").send("later words")
            seen = await _a_turn(_Lines(process.stdout))
            assert seen[-1]["message"]["content"] == "later words"
            await trio.to_thread.run_sync(ok, "delete", "a", "--yes", "--store", store)
            assert await process.wait() == 1
            error = b""
            while chunk := await process.stderr.receive_some():
                error += chunk
            assert error.count(b"\n") == 1, error
            assert b"'a' is not stored" in error
    finally:
        await reap(process)


@pytest.mark.parametrize("made", [True, False], ids=["store-made", "store-not-made-yet"])
async def test_tail_of_a_session_not_stored_yet_says_how_to_wait_and_waits_with_wait(
    tmp_path: Path, made: bool
) -> None:
    """tail of a session the store does not hold fails in one line that says to pass
    --wait (not that it was deleted); with --wait it says on stderr that it waits, then
    prints the session's events from its first one once a process stores it, in a
    SQLite file that exists or in one that the process makes (a server starting), and
    does not say at exit that it made that file."""
    path = tmp_path / "s.db"
    store = f"sqlite:///{path}"
    if made:
        await _store_with_one_session(path)
        for after in ([], ["--after", "0"]):
            line = refused("tail", "later", "--store", store, *after)
            assert "'later' is not in this store" in line, line
            assert "--wait" in line
            assert "deleted" not in line
    process = await _open_tail("later", "--wait", "--store", store)
    try:
        with trio.fail_after(60):
            note = await _Lines(process.stderr).next()
            assert "'later' is not stored yet" in note, note
            assert "waiting for it" in note, note
            assert ("does not exist yet" in note) is not made, note  # (a mistyped --store)
            agent = sa.Agent(model=EchoModel())
            async with sa.open_registry(
                store=sa.SQLiteStore(path), agents={"echo": agent}
            ) as registry:
                await (await registry.spawn("later")).send("first words")
            seen = await _a_turn(_Lines(process.stdout))
            assert seen[0]["skipped_from"] == 1  # the session's first event
            assert seen[-1]["message"]["content"] == "first words"
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
            said = b""
            while chunk := await process.stderr.receive_some():
                said += chunk
            assert b"created a new store" not in said, said  # (the server made it)
    finally:
        await reap(process)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def test_tail_wait_prints_a_session_stored_after_it_started_from_its_first_event(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    """tail --wait prints a session that a process stored after tail started from its
    first event, also when tail first reads the store after that process stored it and
    ran a turn (rather than follow it from now on, as a session stored before)."""
    name = f"fresh-{uuid.uuid4().hex[:8]}"
    if kind == "sqlite":
        path = tmp_path / "s.db"
        await _store_with_one_session(path)
        url = f"sqlite:///{path}"

        def open_store() -> sa.Store:
            return sa.SQLiteStore(path)

    else:
        url = request.getfixturevalue("redis_url").rsplit("/", 1)[0] + "/7"

        def open_store() -> sa.Store:
            return RedisStore(url)

    process = await _open_tail(name, "--wait", "--store", url)
    try:
        # tail has started; it reads the store only once the session and a turn are stored
        process.send_signal(signal.SIGSTOP)
        with trio.fail_after(60):
            agent = sa.Agent(model=EchoModel())
            async with sa.open_registry(store=open_store(), agents={"echo": agent}) as registry:
                await (await registry.spawn(name)).send("first words")
            process.send_signal(signal.SIGCONT)
            seen = await _a_turn(_Lines(process.stdout))
            assert seen[0]["skipped_from"] == 1, seen  # the session's first event
            assert seen[-1]["message"]["content"] == "first words"
    finally:
        process.send_signal(signal.SIGCONT)
        await reap(process)
        if kind == "redis":
            await trio.to_thread.run_sync(ok, "delete", name, "--yes", "--store", url)


async def test_tail_follows_a_served_session_and_stops_on_sigint(tmp_path: Path) -> None:
    """tail prints one JSON line per event that a server in another process stores, from
    the events after --after on, and ends cleanly (status 0, nothing on stderr) on SIGINT."""
    path = tmp_path / "s.db"
    with serving(f"sqlite:{path}") as server:
        populate(server)
        process = await _open_tail("a", "--store", f"sqlite:///{path}", "--after", "0")
        lines = _Lines(process.stdout)
        try:
            with trio.fail_after(60):
                seen = await _a_turn(lines)
                assert seen[-1]["message"]["content"] == "hello from a"
                reply = await trio.to_thread.run_sync(server.ask, "send a later words")
                assert reply == "later words"
                later = await _a_turn(lines)
                assert later[0]["seq"] > seen[-1]["seq"]
                assert later[-1]["message"]["content"] == "later words"
                process.send_signal(signal.SIGINT)
                assert await process.wait() == 0
                assert await process.stderr.receive_some() == b""
        finally:
            await reap(process)


async def test_tail_rides_out_a_store_file_that_reads_as_damaged_for_a_moment(
    tmp_path: Path,
) -> None:
    """tail, which reads a SQLite file read-only beside the process that writes it,
    meets the file reading as damaged (SQLITE_CORRUPT, as a reader may while a writer
    checkpoints) by saying so on stderr, with what to do if it lasts, and retrying:
    once the file reads whole again it prints the session's events."""
    path = tmp_path / "s.db"
    agents = unusable_stores.AGENTS
    async with sa.open_registry(store=SQLiteStore(path), agents=agents) as registry:
        await (await registry.spawn("a")).send("hello")
    whole = path.read_bytes()
    unusable_stores.damage_schema(path)
    process = await _open_tail("a", "--store", f"sqlite:///{path}", "--after", "0")
    try:
        with trio.fail_after(60):
            told = await _Lines(process.stderr).next()
            assert "is damaged" in told, told
            assert "PRAGMA integrity_check" in told, told
            assert "retrying" in told, told
            path.write_bytes(whole)
            seen = await _a_turn(_Lines(process.stdout))
            assert seen[-1]["message"]["content"] == "hello"
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    finally:
        await reap(process)


@attrs.define
class _Lines:
    """The lines of a process's output, one at a time."""

    stream: trio.abc.ReceiveStream
    buffer: bytes = b""

    async def next(self) -> str:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some()
            assert chunk, "the process ended its output"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


async def _open_tail(*args: str) -> trio.Process:
    """A ``sessions tail`` process with these arguments, its stdout and stderr piped."""
    command = [sys.executable, "-m", "sessionactors", "sessions", "tail", *args]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None
    assert process.stderr is not None
    return process


async def _a_turn(lines: _Lines) -> list[dict[str, Any]]:
    """The events tail prints next, up to the first TurnFinished."""
    seen = [json.loads(await lines.next())]
    while seen[-1]["type"] != "TurnFinished":
        seen.append(json.loads(await lines.next()))
    return seen


# ---- redis --------------------------------------------------------------------------


@pytest.mark.redis
def test_read_commands_on_redis_beside_a_server(redis_url: str) -> None:
    """list, show, export and tail work on a Redis store that a server process uses."""
    url = redis_url.rsplit("/", 1)[0] + "/7"
    run = uuid.uuid4().hex[:12]
    with serving(url) as server:
        for name in ("r1", "r2"):
            assert server.ask(f"spawn {run}-{name} run={run}") == "ok"
            assert server.ask(f"send {run}-{name} hi {name}") == f"hi {name}"
        rows = json.loads(ok("list", "--store", url, "--json", "--meta", f"run={run}"))
        assert [r["name"] for r in rows] == [f"{run}-r2", f"{run}-r1"]
        body = json.loads(ok("show", f"{run}-r1", "--store", url, "--json"))
        assert [m["content"] for m in body["messages"]] == ["hi r1", "hi r1"]
        document = json.loads(ok("export", f"{run}-r1", "--store", url))
        assert document["session"]["metadata"] == {"run": run}
        events = ok("tail", f"{run}-r1", "--store", url, "--after", "0", "--no-follow")
        assert "TurnFinished" in events
    assert "deleted" in ok("delete", f"{run}-r1", "--yes", "--store", url)
    assert "deleted" in ok("delete", f"{run}-r2", "--yes", "--store", url)


def shard_mates(name: str, prefix: str, count: int) -> list[str]:
    """``count`` names ``prefix-<k>`` in the shard of ``name`` (``crc32(name) % 1024``)."""
    shard = zlib.crc32(name.encode()) % 1024
    names = (f"{prefix}-{k}" for k in itertools.count())
    return list(
        itertools.islice((n for n in names if zlib.crc32(n.encode()) % 1024 == shard), count)
    )


async def leases_held(url: str) -> dict[str, set[str]]:
    """The owners of the shard leases and of the session leases in the redis at ``url``."""
    async with coredis.Redis.from_url(url, decode_responses=True) as admin:
        return {
            kind: {await admin.hget(key, "owner") or "" for key in await admin.keys(f"*:{kind}")}
            for kind in ("shard", "lease")
        }


@pytest.mark.redis
async def test_write_commands_on_redis_reach_the_worker_that_holds_the_shard(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """Beside a server that holds a shard (it serves a session of it), delete of a hibernated
    session and of a session live in that server, and import, of names in that shard, all
    work: the write goes through the server (a live session's subscribers see its events
    end), and the command leaves no lease behind."""
    with private_redis_server() as url:
        with serving(url) as server:
            await _write_beside(server, url)
            held = await leases_held(url)
            assert len(held["shard"]) == 1  # the server's only
            assert held["lease"] == held["shard"]
        assert await leases_held(url) == {"shard": set(), "lease": set()}
        store = RedisStore(url)  # the check sees a lease left behind
        try:
            lease = await store.claim("anchor", "left-behind", 30.0)
            assert lease is not None
            assert await leases_held(url) == {"shard": {"left-behind"}, "lease": {"left-behind"}}
            await store.release("anchor", lease)
        finally:
            await store.aclose()


async def _write_beside(server: Server, url: str) -> None:
    ask = functools.partial(trio.to_thread.run_sync, server.ask)

    def run(*args: str, stdin: str | None = None) -> Any:
        return trio.to_thread.run_sync(functools.partial(ok, *args, "--store", url, stdin=stdin))

    anchor = "anchor"
    asleep, live, taken = shard_mates(anchor, "mate", 3)
    for name in (anchor, asleep, live, taken):
        assert await ask(f"spawn {name}") == "ok"
        assert await ask(f"send {name} hello {name}") == f"hello {name}"
    assert await ask(f"hibernate {asleep}") == "ok"
    store = RedisStore(url)
    try:  # the premise: the server holds the shard, so a direct claim is refused
        assert await store.claim(asleep, "probe", 30.0) is None
    finally:
        await store.aclose()
    assert (await ask("live")).split() == sorted([anchor, live, taken])
    async with sa.open_registry(store=RedisStore(url)) as watcher:
        async with watcher.ref(live).subscribe() as events:
            deleted = await run("delete", asleep, live, "--yes")
            assert deleted == f"deleted session {asleep!r}\ndeleted session {live!r}\n"
            with trio.fail_after(60), pytest.raises(sa.SessionNotFoundError, match="deleted"):
                async for _ in events:
                    pass  # the deletion ends the stream, saying so
        assert (await ask("live")).split() == sorted([anchor, taken])  # the server deleted it
        for name in (asleep, live):
            assert f"{name!r}" in refused("show", name, "--store", url)
        exported = await run("export", anchor)
        line = await run("import", "-", "--as", live, stdin=exported)  # the name again
        assert f"imported session {live!r}" in line
        seq = json.loads(await run("show", live, "--json"))["event_seq"]
        async with watcher.ref(live).subscribe() as events:
            assert await ask(f"send {live} and on") == "and on"  # the server runs it
            seqs: list[int] = []
            with trio.fail_after(60):
                async for event in events:
                    seqs.append(event.seq)
                    if isinstance(event, sa.TurnFinished):
                        break
        # every event of the turn (the first, the wake's, jumped from the imported seq):
        # the deleted namesake's event stream is gone
        assert seqs[1:] == list(range(seqs[0] + 1, seqs[0] + len(seqs)))
        assert seqs[0] > seq
    line = refused("import", "-", "--as", taken, "--store", url, stdin=exported)
    assert "already exists" in line
    assert "'nobody'" in refused("delete", "nobody", "--yes", "--store", url)


@pytest.mark.redis
async def test_commands_reach_a_redis_store_under_its_own_prefix(redis_url: str) -> None:
    """A store opened with prefix= (applications sharing one database) is reached from
    the command line with ?prefix= in its URL: list, show, export, tail and delete see
    its sessions, and a URL without it (the default prefix) does not."""
    prefix = f"sa-test-cli-{uuid.uuid4().hex[:12]}"
    name = f"chat-{uuid.uuid4().hex[:8]}"
    url = f"{redis_url}?prefix={prefix}"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=RedisStore(redis_url, prefix=prefix), agents=agents) as reg:
        ref = await reg.spawn(name, metadata={"tenant": "acme"})
        await ref.send("hello there")

    def run(*args: str) -> str:
        return ok(*args, "--store", url)

    rows = json.loads(await trio.to_thread.run_sync(run, "list", "--json"))
    assert [r["name"] for r in rows] == [name]
    body = json.loads(await trio.to_thread.run_sync(run, "show", name, "--json"))
    assert [m["content"] for m in body["messages"]] == ["hello there", "hello there"]
    events = await trio.to_thread.run_sync(run, "tail", name, "--no-follow")
    assert "TurnFinished" in events
    default = sessions("list", "--json", "--store", redis_url, "--meta", "tenant=acme")
    assert name not in [r["name"] for r in json.loads(default.stdout)]
    assert f"deleted session {name!r}" in await trio.to_thread.run_sync(
        run, "delete", name, "--yes"
    )
    emptied = await trio.to_thread.run_sync(lambda: sessions("list", "--json", "--store", url))
    assert json.loads(emptied.stdout) == []
    assert "holds no sessions" in emptied.stderr


@pytest.mark.redis
async def test_list_of_a_store_that_holds_no_session_says_so_on_stderr(
    redis_url: str, tmp_path: Path
) -> None:
    """list of a store that holds no session at all (a mistyped ?prefix=, another
    database number, an empty file) prints [] as ever and says on stderr that the store
    is empty and to check the URL; a filter that matches none in a store that holds
    sessions says nothing."""
    prefix = f"sa-test-cli-{uuid.uuid4().hex[:12]}"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=RedisStore(redis_url, prefix=prefix), agents=agents) as reg:
        await (await reg.spawn("held", metadata={"tenant": "acme"})).send("hello")
    other_db = redis_url.rsplit("/", 1)[0] + "/15"
    empty_file = tmp_path / "empty.db"
    empty = SQLiteStore(empty_file)  # (made by its first use)
    assert await empty.list_sessions() == []
    await empty.aclose()
    for url, where in [
        (f"{redis_url}?prefix={prefix}-typo", f"under prefix '{prefix}-typo'"),
        (f"{other_db}?prefix={prefix}", f"under prefix '{prefix}'"),
        (f"sqlite:///{empty_file}", str(empty_file)),
    ]:
        for args in (["--json"], ["--json", "--meta", "tenant=acme"], []):
            run = functools.partial(sessions, "list", *args, "--store", url)
            done = await trio.to_thread.run_sync(run)
            assert done.returncode == 0, done.stderr
            assert done.stdout == ("[]\n" if args else "")
            assert done.stderr.count("\n") == 1, done.stderr
            assert "holds no sessions" in done.stderr, done.stderr
            assert where in done.stderr, done.stderr
            assert "check" in done.stderr, done.stderr
    held = f"{redis_url}?prefix={prefix}"
    assert ok("list", "--json", "--meta", "tenant=globex", "--store", held) == "[]\n"


@pytest.mark.parametrize("case", unusable_stores.CASES[:-1])
async def test_list_of_a_sqlite_file_that_is_no_store_says_what_to_do(
    tmp_path: Path, case: str
) -> None:
    """list --store on a SQLite file that is not a store (text, empty, another program's
    database) or of a newer schema version exits with status 1 and one line naming the
    file and saying what to do; one that this process may not write (the file, its
    directory) it lists, as it only reads. It writes nothing."""
    unusable = await unusable_stores.make(tmp_path, case)
    before = unusable_stores.contents(tmp_path)
    command = [*unprivileged(), sys.executable, "-m", "sessionactors", "sessions", "list"]
    try:
        done = await trio.run_process(
            [*command, "--store", f"sqlite:///{unusable.path}"], capture_stdout=True,
            capture_stderr=True, check=False,
        )  # fmt: skip
    finally:
        unusable_stores.writable(tmp_path)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    if unusable.permissions:
        assert done.returncode == 0, stderr
        assert stdout.split("\t")[0] == "old", stdout
    else:
        assert done.returncode == 1, stdout + stderr
        assert stderr.startswith("sessionactors sessions list: "), stderr
        assert stderr.count("\n") == 1, stderr
        assert repr(str(unusable.path)) in stderr, stderr
        for said in unusable.said:
            assert said in stderr, stderr
    assert unusable_stores.contents(tmp_path) == before


@pytest.mark.redis
async def test_read_commands_work_on_a_redis_without_persistence_and_writes_do_not(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """list, show, export and tail read a Redis that runs without an append-only file
    (reading loses nothing), with no ?persistence=volatile, and also given the URL with
    ?persistence=always that the app's writers use; import and delete, which write, are
    still refused there with the reason (appendonly is off)."""
    with contextlib.ExitStack() as stack:
        url = await trio.to_thread.run_sync(
            stack.enter_context, private_redis_server(config=("--appendonly", "no"))
        )
        agents = {"echo": sa.Agent(model=EchoModel())}
        store = RedisStore(f"{url}?persistence=volatile")
        async with sa.open_registry(store=store, agents=agents) as registry:
            await (await registry.spawn("v")).send("kept in memory")

        def run(*args: str) -> str:
            return ok(*args, "--store", url)

        rows = json.loads(await trio.to_thread.run_sync(run, "list", "--json"))
        assert [r["name"] for r in rows] == ["v"]
        body = json.loads(await trio.to_thread.run_sync(run, "show", "v", "--json"))
        assert [m["content"] for m in body["messages"]] == ["kept in memory"] * 2
        exported = await trio.to_thread.run_sync(run, "export", "v")
        assert json.loads(exported)["session"]["session_id"] == "v"
        events = await trio.to_thread.run_sync(run, "tail", "v", "--no-follow")
        assert "TurnFinished" in events
        demanding = f"{url}?persistence=always"  # (what the app's writers are given)
        rows = json.loads(await trio.to_thread.run_sync(ok, "list", "--json", "--store", demanding))
        assert [r["name"] for r in rows] == ["v"]

        def refused_here(*args: str, stdin: str | None = None) -> str:
            return refused(*args, "--store", url, stdin=stdin)

        line = await trio.to_thread.run_sync(refused_here, "delete", "v", "--yes")
        assert "appendonly is off" in line, line
        line = await trio.to_thread.run_sync(
            functools.partial(refused_here, "import", "-", "--as", "w", stdin=exported)
        )
        assert "appendonly is off" in line, line
        rows = json.loads(await trio.to_thread.run_sync(run, "list", "--json"))
        assert [r["name"] for r in rows] == ["v"]


@pytest.mark.redis
async def test_list_and_show_agree_on_updated_at_after_a_takeover(redis_url: str) -> None:
    """A session whose worker died after a change that carries no time of its own (its
    metadata set) and that another worker then took over has one updated_at: the time
    of that change, in sessions list (its stored info) and sessions show (its snapshot
    and journal), and in the new owner's ref.state() and listing alike."""
    prefix = f"sa-test-cli-{uuid.uuid4().hex[:12]}"
    store = f"{redis_url}?prefix={prefix}"
    ttl = 0.5
    try:
        with trio.fail_after(60):
            with trio.CancelScope() as process:
                async with open_worker(redis_url, prefix, "a", lease_ttl=ttl) as a:
                    ref = await a.spawn("s")
                    await ref.send("hello")
                    await ref.set_metadata({"tenant": "acme"})
                    changed = (await ref.state()).updated_at
                    crash(a)
                    process.cancel()
            await trio.sleep(ttl * 1.5)  # its lease lapses
            async with open_worker(redis_url, prefix, "b", lease_ttl=ttl) as b:
                taken = (await b.ref("s").state()).updated_at  # b takes it over
                [info] = await b.sessions()
                listed = await trio.to_thread.run_sync(ok, "list", "--json", "--store", store)
                shown = await trio.to_thread.run_sync(ok, "show", "s", "--json", "--store", store)
                assert b.live() == ["s"]
        stamps = {
            "a's state": changed.isoformat(),
            "b's state": taken.isoformat(),
            "b's listing": info.updated_at.isoformat(),
            "list": json.loads(listed)[0]["updated_at"],
            "show": json.loads(shown)["updated_at"],
        }
        assert set(stamps.values()) == {changed.isoformat()}, stamps
    finally:
        await drop_prefix(redis_url, prefix)
