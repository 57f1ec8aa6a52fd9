"""SQLite files that a store cannot use, for the tests of what each way in (a registry's
calls, ``sessions list``, ``serve``) says of them: a text file, an empty file, another
program's database, a store of a newer schema version, a store whose file or directory
this process may not write, and a new file in a directory it may not write."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path
from typing import NamedTuple

import sessionactors as sa
from sessionactors.testing import EchoModel

#: The cases, by name.
CASES = (
    "text",
    "empty",
    "another program's",
    "newer schema",
    "read-only file",
    "read-only directory",
    "new file in a read-only directory",
)

#: The agents of the store's sessions ("old" is stored in the cases that hold a store).
AGENTS = {"echo": sa.Agent(model=EchoModel())}


class Unusable(NamedTuple):
    """A path a store cannot use, and what its refusal says of it."""

    path: Path
    #: words of the refusal that say what is wrong and what to do
    said: tuple[str, ...]
    #: whether the case holds only for a process that file permissions apply to
    #: (``processes.unprivileged``)
    permissions: bool


async def make(tmp_path: Path, case: str) -> Unusable:
    """Make ``case`` (one of ``CASES``) under ``tmp_path``; undo its permissions with
    ``writable`` afterwards."""
    path = tmp_path / "store" / "sessions.db"
    path.parent.mkdir()
    if case == "text":
        path.write_text("these are not the sessions you are looking for\n" * 100)
        return Unusable(path, ("not a sessionactors store", "pass the path of a store"), False)
    if case == "empty":
        path.write_bytes(b"")
        return Unusable(path, ("the file is empty", "delete it"), False)
    if case == "another program's":
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE notes (body TEXT)")
        conn.close()
        return Unusable(path, ("does not hold the tables", "pass the path of a store"), False)
    if case == "new file in a read-only directory":
        path.parent.chmod(0o555)
        return Unusable(path, ("read-only for this process", "writable"), True)
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=AGENTS) as registry:
        await (await registry.spawn("old")).send("hello")
    if case == "newer schema":
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA user_version = 99")
        conn.close()
        return Unusable(path, ("schema version 99", "Upgrade sessionactors"), False)
    if case == "read-only file":
        path.chmod(0o444)
    else:
        assert case == "read-only directory", case
        path.parent.chmod(0o555)
    return Unusable(path, ("read-only for this process", "readonly=True"), True)


def damage_schema(path: Path) -> None:
    """Overwrite the first page of the SQLite file at ``path`` after its header (where
    the file's schema begins): SQLite then reads the file as damaged (SQLITE_CORRUPT)."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[16:18], "big")
    data[100:size] = b"\xff" * (size - 100)
    path.write_bytes(bytes(data))


def writable(tmp_path: Path) -> None:
    """Give the files of a case made under ``tmp_path`` their permissions back."""
    for directory, _, files in os.walk(tmp_path):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)


def contents(tmp_path: Path) -> dict[str, str]:
    """Every file under ``tmp_path`` and a digest of its bytes: to show that nothing
    was written."""
    found = {}
    for directory, _, files in os.walk(tmp_path):
        for name in files:
            file = Path(directory, name)
            found[str(file.relative_to(tmp_path))] = hashlib.sha256(file.read_bytes()).hexdigest()
    return found
