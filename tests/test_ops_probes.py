"""Probes of the operators' tools and the stores at their edges: hostile input, odd
files, and what is left behind."""

from __future__ import annotations

import base64
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import sessionactors as sa
from sessionactors.testing import export_document
from test_cli_sessions import sessions


def refused(*args: str, stdin: str | None = None) -> str:
    done = sessions(*args, stdin=stdin)
    assert done.returncode != 0, done.stdout
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def hostile_export(name: str) -> str:
    """A faithful export (its ``session`` matches its ``snapshot``) of a session named
    ``name``, as an attacker can write one."""
    now = datetime.datetime.now(datetime.UTC)
    state = sa.SessionState(
        session_id=name,
        agent="echo",
        created_at=now,
        updated_at=now,
        event_seq=2,
        messages=(sa.Message(id="m1", role=sa.Role.USER, content="hi", created_at=now),),
    )
    return json.dumps(export_document(state, exported_at=now))


@pytest.mark.parametrize("name", ["", "a\nb", "a\x00b", "x" * 300])
def test_import_refuses_an_export_whose_session_name_is_invalid(tmp_path: Path, name: str) -> None:
    """An export's name is input like any other: a name that spawn refuses is refused
    by import, before anything is written (else the session is stored under a name
    that no command can show or delete)."""
    store = f"sqlite:///{tmp_path / 's.db'}"
    line = refused("import", "-", "--store", store, stdin=hostile_export(name))
    assert "session name" in line
    assert "--as" in line
    assert not (tmp_path / "s.db").exists()
    # a valid name given with --as restores it
    done = sessions("import", "-", "--as", "fixed", "--store", store, stdin=hostile_export(name))
    assert done.returncode == 0, done.stderr


def test_delete_on_a_missing_sqlite_file_creates_no_file(tmp_path: Path) -> None:
    """A mistyped --store path for delete is refused without creating a store there
    (nothing is written for a command that finds nothing to delete)."""
    path = tmp_path / "typo.db"
    line = refused("delete", "x", "--yes", "--store", f"sqlite:///{path}")
    assert "not stored" in line
    assert "does not exist" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_import_refuses_an_export_whose_reviews_belong_to_another_session(
    tmp_path: Path,
) -> None:
    """A pending review in an export names its session; one that names another session
    is refused (else registry.pending_reviews() lists, under the victim's name, a tool
    call the victim never made)."""
    now = datetime.datetime.now(datetime.UTC)
    call = sa.ToolCall(id="c1", name="refund", arguments="{}")
    state = sa.SessionState(
        session_id="s",
        agent="echo",
        created_at=now,
        updated_at=now,
        event_seq=4,
        messages=(
            sa.Message(id="m1", role=sa.Role.USER, content="refund", created_at=now),
            sa.Message(
                id="m2", role=sa.Role.ASSISTANT, content="", tool_calls=(call,), created_at=now
            ),
        ),
        reviews=(sa.ReviewRequest(id="r1", session_id="victim", tool_call=call, created_at=now),),
    )
    document = json.dumps(export_document(state, exported_at=now))
    store = f"sqlite:///{tmp_path / 's.db'}"
    line = refused("import", "-", "--store", store, stdin=document)
    assert "'victim'" in line
    assert "'s'" in line
    assert not (tmp_path / "s.db").exists()


async def test_tail_does_not_follow_a_session_made_again_under_its_name_as_if_it_were_the_same(
    tmp_path: Path,
) -> None:
    """A session deleted and made again under its name between two reads of ``tail``
    is another conversation: tail ends with one line naming it, rather than skipping
    the new session's first events (their seqs are below the old ones) and printing
    its later ones as if they went on from the old session's."""
    import trio

    from sessionactors.testing import EchoModel

    path = tmp_path / "s.db"
    agents = {"echo": sa.Agent(model=EchoModel())}
    tail = subprocess.Popen(
        [sys.executable, "-m", "sessionactors", "sessions", "tail", "a", "--after", "0",
         "--store", f"sqlite:///{path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert tail.stdout is not None
    assert tail.stderr is not None
    printed: list[dict[str, Any]] = []
    try:
        with trio.fail_after(60):
            async with sa.open_registry(store=sa.SQLiteStore(str(path)), agents=agents) as reg:
                ref = await reg.spawn("a")
                await ref.send("old words")
                while not any(e["type"] == "TurnFinished" for e in printed):
                    printed.append(json.loads(await trio.to_thread.run_sync(tail.stdout.readline)))
                await reg.delete("a")  # between two reads of tail (one every 0.5 s)
                ref = await reg.spawn("a")
                for n in range(3):
                    await ref.send(f"new words {n}")
                await trio.sleep(2)  # tail read the store again
    finally:
        tail.terminate()
        rest, errors = tail.communicate(timeout=30)
    printed += [json.loads(line) for line in rest.splitlines()]
    texts = [e["message"]["content"] for e in printed if e["type"] == "TurnStarted"]
    if "new words 0" not in texts:  # it ended, naming the session
        assert "'a'" in errors, (errors, texts)
        assert texts == ["old words"], texts
    else:  # followed on: then it must not have skipped the new session's first events
        assert texts == ["old words", "new words 0", "new words 1", "new words 2"], texts


async def test_a_reader_that_stops_early_is_no_error(tmp_path: Path) -> None:
    """``sessions list | head -1`` is how operators peek at a big store: when the
    reader closes the pipe, the command stops quietly (no error line on stderr, the
    status of a process whose pipe closed: 141), as other shell tools do."""
    from sessionactors.testing import EchoModel

    path = tmp_path / "many.db"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(str(path)), agents=agents) as registry:
        for i in range(2000):
            await registry.spawn(f"s{i:05d}", metadata={"pad": "x" * 100})
    process = subprocess.Popen(
        [sys.executable, "-m", "sessionactors", "sessions", "list", "--store", f"sqlite:///{path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    assert process.stdout.readline().startswith(b"s01999\t")
    process.stdout.close()
    assert process.wait(60) == 141
    assert process.stderr.read() == b""
    process.stderr.close()


@pytest.mark.parametrize("status", ["running", "waiting", "failed"])
def test_an_imported_session_is_never_listed_as_running(tmp_path: Path, status: str) -> None:
    """Import stores a session as hibernated (a stopped one stays stopped, one never
    used stays new): an export of an empty session that says it is running, waiting or
    failed is not listed that way (no process runs it; `list --status running` would
    show a session that nothing runs)."""
    import sessionactors as sa

    now = datetime.datetime.now(datetime.UTC)
    state = sa.SessionState(
        session_id="s", agent="echo", status=sa.Status(status), created_at=now, updated_at=now
    )
    store = f"sqlite:///{tmp_path / 's.db'}"
    document = json.dumps(export_document(state, exported_at=now))
    assert sessions("import", "-", "--store", store, stdin=document).returncode == 0
    listed = json.loads(sessions("list", "--json", "--store", store).stdout)
    assert [row["status"] for row in listed] == ["hibernated"]


def _messages_export(*messages: sa.Message) -> str:
    now = datetime.datetime.now(datetime.UTC)
    state = sa.SessionState(
        session_id="s", agent="echo", created_at=now, updated_at=now, event_seq=9,
        messages=messages,
    )  # fmt: skip
    return json.dumps(export_document(state, exported_at=now))


@pytest.mark.parametrize("problem", ["orphan tool result", "repeated id", "user calls a tool"])
def test_import_refuses_a_history_that_breaks_the_history_rules(
    tmp_path: Path, problem: str
) -> None:
    """An export's history is checked by the rules every other way into a history
    (add_messages, replace_history) enforces: unique ids, tool calls only from the
    assistant, no tool result without its call; else every later turn sends the
    model a history it refuses. Refused before anything is written."""
    now = datetime.datetime.now(datetime.UTC)
    user = sa.Message(id="m1", role=sa.Role.USER, content="hi", created_at=now)
    call = sa.ToolCall(id="c1", name="t", arguments="{}")
    history = {
        "orphan tool result": (
            user,
            sa.Message(
                id="m2", role=sa.Role.TOOL, content="r", tool_call_id="nope", created_at=now
            ),
        ),
        "repeated id": (
            user,
            sa.Message(id="m1", role=sa.Role.ASSISTANT, content="y", created_at=now),
        ),
        "user calls a tool": (
            sa.Message(
                id="m1", role=sa.Role.USER, content="hi", tool_calls=(call,), created_at=now
            ),
        ),
    }[problem]
    store = f"sqlite:///{tmp_path / 's.db'}"
    line = refused("import", "-", "--store", store, stdin=_messages_export(*history))
    assert "'s'" in line
    assert not (tmp_path / "s.db").exists()


def test_import_takes_a_turn_cut_between_its_tool_call_and_its_result(tmp_path: Path) -> None:
    """The history check of import lets through what a session can hold: a last
    assistant message whose calls wait for results (a review, a cut turn)."""
    now = datetime.datetime.now(datetime.UTC)
    call = sa.ToolCall(id="c1", name="t", arguments="{}")
    history = (
        sa.Message(id="m1", role=sa.Role.USER, content="hi", created_at=now),
        sa.Message(id="m2", role=sa.Role.ASSISTANT, content="", tool_calls=(call,), created_at=now),
    )
    store = f"sqlite:///{tmp_path / 's.db'}"
    done = sessions("import", "-", "--store", store, stdin=_messages_export(*history))
    assert done.returncode == 0, done.stderr


def test_an_export_written_at_the_previous_snapshot_version_still_imports(
    tmp_path: Path,
) -> None:
    """An export whose snapshot is of schema version 1 (written before the journal's
    retention marks joined the state) imports: its snapshot is migrated, and its readable
    session, which says version 1, still matches it."""
    golden = (Path(__file__).parent / "golden" / "snapshot_v1_full.msgpack").read_bytes()
    now = datetime.datetime.now(datetime.UTC)
    document = export_document(sa.load_snapshot(golden), exported_at=now)
    document["snapshot"] = base64.b64encode(golden).decode("ascii")
    document["session"]["schema_version"] = 1
    store = f"sqlite:///{tmp_path / 's.db'}"
    done = sessions("import", "-", "--store", store, stdin=json.dumps(document))
    assert done.returncode == 0, done.stderr
    shown = sessions("show", "golden-full", "--json", "--store", store)
    assert shown.returncode == 0, shown.stderr
