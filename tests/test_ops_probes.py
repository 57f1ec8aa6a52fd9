"""Probes of the operators' tools and the stores at their edges: hostile input, odd
files, and what is left behind."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sessionactors._export import dump_export
from sessionactors._records import Message, Role, SessionState


def sessions(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sessionactors", "sessions", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


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
    state = SessionState(
        session_id=name,
        agent="echo",
        created_at=now,
        updated_at=now,
        event_seq=2,
        messages=(Message(id="m1", role=Role.USER, content="hi", created_at=now),),
    )
    return json.dumps(dump_export(state, exported_at=now))


@pytest.mark.parametrize("name", ["", "a\nb", "a\x00b", "x" * 300])
def test_import_refuses_an_export_whose_session_name_is_invalid(
    tmp_path: Path, name: str
) -> None:
    """An export's name is input like any other: a name that spawn refuses is refused
    by import, before anything is written (else the session is stored under a name
    that no command can show or delete)."""
    store = f"sqlite:///{tmp_path / 's.db'}"
    line = refused("import", "-", "--store", store, stdin=hostile_export(name))
    assert "session name" in line and "--as" in line
    assert not (tmp_path / "s.db").exists()
    # a valid name given with --as restores it
    done = sessions("import", "-", "--as", "fixed", "--store", store, stdin=hostile_export(name))
    assert done.returncode == 0, done.stderr


def test_delete_on_a_missing_sqlite_file_creates_no_file(tmp_path: Path) -> None:
    """A mistyped --store path for delete is refused without creating a store there
    (nothing is written for a command that finds nothing to delete)."""
    path = tmp_path / "typo.db"
    line = refused("delete", "x", "--yes", "--store", f"sqlite:///{path}")
    assert "not stored" in line and "does not exist" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_import_refuses_an_export_whose_reviews_belong_to_another_session(
    tmp_path: Path,
) -> None:
    """A pending review in an export names its session; one that names another session
    is refused (else registry.pending_reviews() lists, under the victim's name, a tool
    call the victim never made)."""
    from sessionactors._records import ReviewRequest, ToolCall

    now = datetime.datetime.now(datetime.UTC)
    call = ToolCall(id="c1", name="refund", arguments="{}")
    state = SessionState(
        session_id="s",
        agent="echo",
        created_at=now,
        updated_at=now,
        event_seq=4,
        messages=(
            Message(id="m1", role=Role.USER, content="refund", created_at=now),
            Message(id="m2", role=Role.ASSISTANT, content="", tool_calls=(call,), created_at=now),
        ),
        reviews=(ReviewRequest(id="r1", session_id="victim", tool_call=call, created_at=now),),
    )
    document = json.dumps(dump_export(state, exported_at=now))
    store = f"sqlite:///{tmp_path / 's.db'}"
    line = refused("import", "-", "--store", store, stdin=document)
    assert "'victim'" in line and "'s'" in line
    assert not (tmp_path / "s.db").exists()
